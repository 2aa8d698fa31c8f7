"""Pool strategies and aging (issue 15): the place in line as two columns, fast path v6.

Each demand row carries its place in its pool's line, ``(line_round, line_at)``, set by the
pool's strategy when the row joins the line (:mod:`pools.core.strategies`); the line index
``pools_demand_line`` now orders by them. Existing rows get the ``priority`` order they had
(``-priority``, ``enqueued_at``). ``pools_demand_fair_key`` finds a fairness key's latest
round. Version 6 of the stored functions (``pools/pg/sql/admission_v6.sql``) admits in that
order and places new entries by strategy. Going back re-creates version 5.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import django.core.validators
from django.db import migrations, models
from django.db.models import F

SQL_DIR = Path(__file__).resolve().parent.parent / "pg" / "sql"
SQL_V6 = SQL_DIR / "admission_v6.sql"
SQL_V5 = SQL_DIR / "admission_v5.sql"
DROP_V5 = """
DROP FUNCTION IF EXISTS pools_enqueue_v5(
    text, text, jsonb, jsonb, jsonb, jsonb, integer, timestamptz, timestamptz, timestamptz,
    text, text, text, integer, double precision, boolean, integer
);
DROP FUNCTION IF EXISTS pools_start_v5(
    bigint, bigint, text, timestamptz, double precision, boolean, integer
);
DROP FUNCTION IF EXISTS pools_settle_v5(
    bigint, bigint, text, text, boolean, timestamptz, double precision, boolean, integer
);
DROP FUNCTION IF EXISTS pools_admit_v5(bigint[], timestamptz, double precision, boolean);
DROP FUNCTION IF EXISTS pools_out_v5(
    text, bigint, text, bigint, text, text, jsonb, jsonb, jsonb, jsonb, text, text, bigint,
    bigint, timestamptz, bigint, text, jsonb
);
"""
DROP_V6 = DROP_V5.replace("_v5", "_v6").replace(
    "text, text, text, integer, double precision, boolean, integer\n);",
    "text, text, text, integer, double precision, boolean, text, integer\n);",
    1,
)
FAIR_STATES = ("waiting", "admitted", "running", "succeeded", "failed", "retried")


def _swap(create: Path, drop: str) -> Any:
    def run(apps: Any, schema_editor: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            with schema_editor.connection.cursor() as cursor:
                cursor.execute(create.read_text())
                cursor.execute(drop)

    return run


def _priority_places(apps: Any, schema_editor: Any) -> None:
    """Rows so far were in ``priority`` order: keep it."""
    Demand = apps.get_model("pools", "Demand")
    Demand.objects.update(line_round=F("priority") * -1, line_at=F("enqueued_at"))


class Migration(migrations.Migration):
    dependencies = [("pools", "0013_audit_actor_and_template_pools")]

    operations = [
        migrations.AddField(
            model_name="pool",
            name="strategy",
            field=models.CharField(
                choices=[
                    ("priority", "priority, then first come first served"),
                    ("fifo", "first come first served"),
                    ("lifo", "last come first served"),
                    ("fair", "round robin across fairness keys"),
                ],
                db_default="priority",
                default="priority",
                help_text="The order in which waiting entries are admitted.",
                max_length=8,
                verbose_name="strategy",
            ),
        ),
        migrations.AddField(
            model_name="pool",
            name="aging_seconds",
            field=models.PositiveIntegerField(
                blank=True,
                help_text="Strategy 'priority' only: a waiting entry gains one priority level "
                "per this many seconds waited. Empty means no aging.",
                null=True,
                validators=[django.core.validators.MinValueValidator(1)],
                verbose_name="aging seconds",
            ),
        ),
        migrations.AddField(
            model_name="pool",
            name="fair_round",
            field=models.BigIntegerField(
                db_default=0, default=0, editable=False, verbose_name="fair round"
            ),
        ),
        migrations.AddField(
            model_name="queueentry",
            name="fairness_key",
            field=models.CharField(
                blank=True, db_default="", default="", max_length=255, verbose_name="fairness key"
            ),
        ),
        migrations.AddField(
            model_name="demand",
            name="fairness_key",
            field=models.CharField(blank=True, max_length=255, null=True),
        ),
        migrations.AddField(
            model_name="demand",
            name="line_round",
            field=models.BigIntegerField(db_default=0, default=0),
        ),
        migrations.AddField(
            model_name="demand",
            name="line_at",
            field=models.DateTimeField(null=True),
        ),
        migrations.RunPython(_priority_places, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="demand",
            name="line_at",
            field=models.DateTimeField(),
        ),
        migrations.RemoveIndex(model_name="demand", name="pools_demand_line"),
        migrations.AddIndex(
            model_name="demand",
            index=models.Index(
                fields=["pool", "state", "line_round", "line_at", "entry"],
                name="pools_demand_line",
            ),
        ),
        migrations.AddIndex(
            model_name="demand",
            index=models.Index(
                condition=models.Q(fairness_key__isnull=False, state__in=FAIR_STATES),
                fields=["pool", "fairness_key", "line_round"],
                name="pools_demand_fair_key",
            ),
        ),
        migrations.RunPython(_swap(SQL_V6, DROP_V5), _swap(SQL_V5, DROP_V6)),
    ]
