"""Fast-path functions version 3 (``pools/pg/sql/admission_v3.sql``) replace version 2.

Version 3 returns named columns (one meaning per column), refuses in the contract's
precedence (docs/concepts/contract.md), returns the event rows it wrote when asked (so
lifecycle signals no longer need the ORM path) and the pools' timed wake-ups. The file
of version 2 stays as migration 0004 created it; going back re-creates version 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.db import migrations

SQL_DIR = Path(__file__).resolve().parent.parent / "pg" / "sql"
SQL_V3 = SQL_DIR / "admission_v3.sql"
SQL_V2 = SQL_DIR / "admission_v2.sql"
DROP_V2 = """
DROP FUNCTION IF EXISTS pools_enqueue_v2(
    text, text, jsonb, jsonb, jsonb, jsonb, integer, timestamptz, timestamptz, timestamptz,
    text, text, text, integer, double precision, integer
);
DROP FUNCTION IF EXISTS pools_start_v2(bigint, bigint, text, timestamptz, double precision);
DROP FUNCTION IF EXISTS pools_settle_v2(
    bigint, bigint, text, text, boolean, timestamptz, double precision, integer
);
DROP FUNCTION IF EXISTS pools_admit_v2(bigint[], timestamptz, double precision);
"""
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


def _swap(create: Path, drop: str) -> Any:
    def run(apps: Any, schema_editor: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            with schema_editor.connection.cursor() as cursor:
                cursor.execute(create.read_text())
                cursor.execute(drop)

    return run


class Migration(migrations.Migration):
    dependencies = [("pools", "0005_entry_permissions")]

    operations = [
        migrations.RunPython(_swap(SQL_V3, DROP_V2), _swap(SQL_V2, DROP_V3)),
    ]
