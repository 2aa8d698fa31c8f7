"""Fast-path functions version 7 (issue 15, daily spend caps): capped pools fall back.

``pools/pg/sql/admission_v7_spend.sql`` is version 5 with one rule more: a pool with a
``spend_cap`` is a 'fallback' pool, decided by the Python pass. Going back re-creates
version 5. (Version 6 belongs to another branch; the lead ports the rule there.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.db import migrations

SQL_DIR = Path(__file__).resolve().parent.parent / "pg" / "sql"
SQL_V7 = SQL_DIR / "admission_v7_spend.sql"
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
DROP_V7 = DROP_V5.replace("_v5", "_v7")


def _swap(create: Path, drop: str) -> Any:
    def run(apps: Any, schema_editor: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            with schema_editor.connection.cursor() as cursor:
                cursor.execute(create.read_text())
                cursor.execute(drop)

    return run


class Migration(migrations.Migration):
    dependencies = [("pools", "0016_spend_cap")]

    operations = [migrations.RunPython(_swap(SQL_V7, DROP_V5), _swap(SQL_V5, DROP_V7))]
