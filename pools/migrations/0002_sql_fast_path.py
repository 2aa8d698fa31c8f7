"""PostgreSQL functions of the admission fast path (``pools/pg/sql/admission_v1.sql``).

Nothing is created on other databases: they use the ORM path of :mod:`pools.core.admission`.
A later version of the functions gets a new file and a new migration, so this one
keeps meaning what it meant.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.db import migrations

SQL = Path(__file__).resolve().parent.parent / "pg" / "sql" / "admission_v1.sql"
DROP = """
DROP FUNCTION IF EXISTS pools_enqueue_v1(
    text, text, jsonb, jsonb, jsonb, jsonb, integer, timestamptz, timestamptz, timestamptz,
    text, text, text, integer, double precision, integer
);
DROP FUNCTION IF EXISTS pools_start_v1(bigint, bigint, text, timestamptz, double precision);
DROP FUNCTION IF EXISTS pools_settle_v1(
    bigint, bigint, text, text, boolean, timestamptz, double precision, integer
);
DROP FUNCTION IF EXISTS pools_admit_v1(bigint[], timestamptz, double precision);
"""


def _run(sql: Callable[[], str]) -> Callable[[Any, Any], None]:
    def run(apps: Any, schema_editor: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            with schema_editor.connection.cursor() as cursor:
                cursor.execute(sql())

    return run


class Migration(migrations.Migration):
    dependencies = [("pools", "0001_initial")]

    operations = [
        migrations.RunPython(_run(SQL.read_text), _run(lambda: DROP)),
    ]
