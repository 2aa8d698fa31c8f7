"""Entry indexes without ``state``, and free space on each page: start as a HOT update.

PostgreSQL writes a changed row without touching any index (a HOT update) only when no
indexed column changes and the new version fits on the same page. The three partial
indexes of migration 0003 led with ``state``, which every transition changes, so every
transition wrote an entry into every index of the table. Their conditions already say
what they are for: a lease is set exactly while an entry holds its slots, a finish time
exactly once it is finished. So they index their column alone, and the deadline index
holds unfinished entries only. A start (``admitted`` -> ``running``, keeping a lease with
most of its time left) then changes no indexed column; ``fillfactor`` 80 leaves room on
the page for its new version.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models


def _fillfactor(value: int) -> Any:
    def run(apps: Any, schema_editor: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            table = schema_editor.quote_name("pools_queueentry")
            schema_editor.execute(f"ALTER TABLE {table} SET (fillfactor = {int(value)})")

    return run


class Migration(migrations.Migration):
    dependencies = [("pools", "0007_lean_hot_path")]

    operations = [
        migrations.RemoveIndex(model_name="queueentry", name="pools_entry_state_lease"),
        migrations.RemoveIndex(model_name="queueentry", name="pools_entry_state_deadline"),
        migrations.RemoveIndex(model_name="queueentry", name="pools_entry_state_finished"),
        migrations.AddIndex(
            model_name="queueentry",
            index=models.Index(
                condition=models.Q(lease_expires_at__isnull=False),
                fields=["lease_expires_at"],
                name="pools_entry_lease",
            ),
        ),
        migrations.AddIndex(
            model_name="queueentry",
            index=models.Index(
                condition=models.Q(deadline__isnull=False, finished_at__isnull=True),
                fields=["deadline"],
                name="pools_entry_deadline",
            ),
        ),
        migrations.AddIndex(
            model_name="queueentry",
            index=models.Index(
                condition=models.Q(finished_at__isnull=False),
                fields=["finished_at"],
                name="pools_entry_finished",
            ),
        ),
        migrations.RunPython(_fillfactor(80), _fillfactor(100)),
    ]
