"""A lean hot path: held slots as a counter on the pool row, fast-path functions version 4.

``Pool.held`` is the number of slots held by the pool's admitted and running entries,
kept under the pool's row lock by admission and settle (and checked against the holders
by the sweep), so an admission pass reads one column instead of summing demand rows.
It is filled here from the demand rows. Version 4 of the stored functions
(``pools/pg/sql/admission_v4.sql``) keeps it, writes no event rows for the normal
transitions (the entry carries their times) and takes the lock bound as an argument.
Going back re-creates version 3 (which ignores the counter).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.db import migrations, models

SQL_DIR = Path(__file__).resolve().parent.parent / "pg" / "sql"
SQL_V4 = SQL_DIR / "admission_v4.sql"
SQL_V3 = SQL_DIR / "admission_v3.sql"
DROP_V3 = """
DROP FUNCTION IF EXISTS pools_enqueue_v3(
    text, text, jsonb, jsonb, jsonb, jsonb, integer, timestamptz, timestamptz, timestamptz,
    text, text, text, integer, double precision, boolean
);
DROP FUNCTION IF EXISTS pools_start_v3(
    bigint, bigint, text, timestamptz, double precision, boolean
);
DROP FUNCTION IF EXISTS pools_settle_v3(
    bigint, bigint, text, text, boolean, timestamptz, double precision, boolean
);
DROP FUNCTION IF EXISTS pools_admit_v3(bigint[], timestamptz, double precision, boolean);
DROP FUNCTION IF EXISTS pools_out_v3(
    text, bigint, text, bigint, text, text, jsonb, jsonb, jsonb, jsonb, text, text, bigint,
    bigint, timestamptz, bigint, text, jsonb
);
"""
DROP_V4 = """
DROP FUNCTION IF EXISTS pools_enqueue_v4(
    text, text, jsonb, jsonb, jsonb, jsonb, integer, timestamptz, timestamptz, timestamptz,
    text, text, text, integer, double precision, boolean, integer
);
DROP FUNCTION IF EXISTS pools_start_v4(
    bigint, bigint, text, timestamptz, double precision, boolean, integer
);
DROP FUNCTION IF EXISTS pools_settle_v4(
    bigint, bigint, text, text, boolean, timestamptz, double precision, boolean, integer
);
DROP FUNCTION IF EXISTS pools_admit_v4(bigint[], timestamptz, double precision, boolean);
DROP FUNCTION IF EXISTS pools_out_v4(
    text, bigint, text, bigint, text, text, jsonb, jsonb, jsonb, jsonb, text, text, bigint,
    bigint, timestamptz, bigint, text, jsonb
);
"""


def _fill_held(apps: Any, schema_editor: Any) -> None:
    Pool = apps.get_model("pools", "Pool")
    Demand = apps.get_model("pools", "Demand")
    held: dict[int, int] = {}
    for pool_id, slots in Demand.objects.filter(state__in=["admitted", "running"]).values_list(
        "pool_id", "slots"
    ):
        held[pool_id] = held.get(pool_id, 0) + slots
    for pool_id, slots in held.items():
        Pool.objects.filter(pk=pool_id).update(held=slots)


def _swap(create: Path, drop: str) -> Any:
    def run(apps: Any, schema_editor: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            with schema_editor.connection.cursor() as cursor:
                cursor.execute(create.read_text())
                cursor.execute(drop)

    return run


class Migration(migrations.Migration):
    dependencies = [("pools", "0006_sql_functions_v3")]

    operations = [
        migrations.AddField(
            model_name="pool",
            name="held",
            field=models.PositiveIntegerField(
                default=0,
                editable=False,
                help_text="Slots held by admitted and running entries (kept by admission).",
                verbose_name="held",
            ),
        ),
        migrations.RunPython(_fill_held, migrations.RunPython.noop),
        migrations.RunPython(_swap(SQL_V4, DROP_V3), _swap(SQL_V3, DROP_V4)),
    ]
