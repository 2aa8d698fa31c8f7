"""The order of admissions: ``Pool.admissions`` and ``QueueEntry.admission_seq``.

With the normal transitions no longer logged (0007), the ids of ``admitted`` event rows
no longer give the order in which entries took their slots, and ``admitted_at`` cannot:
it is the admitting call's clock, read before the call waited for the pool's lock. The
pool now counts its admissions under that lock, and each admitted entry keeps its place
in the count. The fast-path functions of version 4 are (re)created here, as they write
both columns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.db import migrations, models

SQL_V4 = Path(__file__).resolve().parent.parent / "pg" / "sql" / "admission_v4.sql"


def _create_v4(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        with schema_editor.connection.cursor() as cursor:
            cursor.execute(SQL_V4.read_text())


class Migration(migrations.Migration):
    dependencies = [("pools", "0008_entry_indexes_without_state")]

    operations = [
        migrations.AddField(
            model_name="pool",
            name="admissions",
            field=models.PositiveBigIntegerField(
                default=0, editable=False, verbose_name="admissions"
            ),
        ),
        migrations.AddField(
            model_name="queueentry",
            name="admission_seq",
            field=models.PositiveBigIntegerField(
                blank=True, null=True, verbose_name="admission order"
            ),
        ),
        migrations.RunPython(_create_v4, migrations.RunPython.noop),
    ]
