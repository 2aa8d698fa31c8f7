"""Entries not yet due are out of line; fast-path functions version 2.

Demand rows of a waiting entry whose ``not_before`` is ahead become ``delayed`` with
their due time as ``enqueued_at`` (they join the line when due), a partial index finds
the next due row per pool, and the stored functions of ``pools/pg/sql/admission_v2.sql``
replace version 1 (whose file stays as migration 0002 created it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.db import migrations, models

SQL_V2 = Path(__file__).resolve().parent.parent / "pg" / "sql" / "admission_v2.sql"
SQL_V1 = Path(__file__).resolve().parent.parent / "pg" / "sql" / "admission_v1.sql"


def _drop(version: int) -> str:
    return f"""
DROP FUNCTION IF EXISTS pools_enqueue_v{version}(
    text, text, jsonb, jsonb, jsonb, jsonb, integer, timestamptz, timestamptz, timestamptz,
    text, text, text, integer, double precision, integer
);
DROP FUNCTION IF EXISTS pools_start_v{version}(bigint, bigint, text, timestamptz, double precision);
DROP FUNCTION IF EXISTS pools_settle_v{version}(
    bigint, bigint, text, text, boolean, timestamptz, double precision, integer
);
DROP FUNCTION IF EXISTS pools_admit_v{version}(bigint[], timestamptz, double precision);
"""


def _functions(create: Path, drop: int) -> Any:
    def run(apps: Any, schema_editor: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            with schema_editor.connection.cursor() as cursor:
                cursor.execute(create.read_text())
                cursor.execute(_drop(drop))

    return run


def _delay_entries_not_due(apps: Any, schema_editor: Any) -> None:
    from django.utils import timezone

    demand = apps.get_model("pools", "Demand")
    now = timezone.now()
    rows = demand.objects.filter(state="waiting", entry__not_before__gt=now).select_related("entry")
    pool = apps.get_model("pools", "Pool")
    for row in rows.iterator():
        row.state = "delayed"
        row.enqueued_at = row.entry.not_before
        row.save(update_fields=["state", "enqueued_at"])
        pool.objects.filter(pk=row.pool_id, next_due_at__isnull=True).update(
            next_due_at=row.enqueued_at
        )
        pool.objects.filter(pk=row.pool_id, next_due_at__gt=row.enqueued_at).update(
            next_due_at=row.enqueued_at
        )


def _undelay(apps: Any, schema_editor: Any) -> None:
    apps.get_model("pools", "Demand").objects.filter(state="delayed").update(state="waiting")


class Migration(migrations.Migration):
    dependencies = [("pools", "0003_slimmer_indexes")]

    operations = [
        migrations.AddField(
            model_name="pool",
            name="next_due_at",
            field=models.DateTimeField(
                blank=True, editable=False, null=True, verbose_name="next due at"
            ),
        ),
        migrations.AlterField(
            model_name="demand",
            name="state",
            field=models.CharField(
                choices=[
                    ("waiting", "waiting"),
                    ("admitted", "admitted"),
                    ("running", "running"),
                    ("succeeded", "succeeded"),
                    ("failed", "failed"),
                    ("cancelled", "cancelled"),
                    ("expired", "expired"),
                    ("rejected", "rejected"),
                    ("superseded", "superseded"),
                    ("retried", "retried"),
                    ("delayed", "delayed (not yet due)"),
                ],
                default="waiting",
                max_length=12,
            ),
        ),
        migrations.AddIndex(
            model_name="demand",
            index=models.Index(
                condition=models.Q(("state", "delayed")),
                fields=["pool", "enqueued_at"],
                name="pools_demand_delayed",
            ),
        ),
        migrations.RunPython(_delay_entries_not_due, _undelay),
        migrations.RunPython(_functions(SQL_V2, 1), _functions(SQL_V1, 2)),
    ]
