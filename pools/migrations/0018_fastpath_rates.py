"""Rate limits on the fast path (issue 17): version 7 of the stored functions.

``pools_admit_v7`` checks and writes a rated pool's windows itself (``pools_ratemark``,
migration 0017) instead of handing the pool to the Python pass: a rate that never binds
costs a few index reads and an upsert per admission, not a second pass
(``pools/pg/sql/admission_v7.sql``).

Expand only: version 6 stays, so the previous release's web processes and workers keep
calling it while this release migrates and rolls out (``docs/howto/upgrading.md``). Its
functions are dropped one release later. Going back drops version 7.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.db import migrations

SQL_DIR = Path(__file__).resolve().parent.parent / "pg" / "sql"


def _drop(version: int) -> str:
    """``DROP FUNCTION`` of every function of a version (v6 and v7 share signatures)."""
    v = f"_v{version}"
    return f"""
DROP FUNCTION IF EXISTS pools_enqueue{v}(
    text, text, jsonb, jsonb, jsonb, jsonb, integer, timestamptz, timestamptz, timestamptz,
    text, text, text, integer, double precision, boolean, text, integer
);
DROP FUNCTION IF EXISTS pools_start{v}(
    bigint, bigint, text, timestamptz, double precision, boolean, integer
);
DROP FUNCTION IF EXISTS pools_settle{v}(
    bigint, bigint, text, text, boolean, timestamptz, double precision, boolean, integer
);
DROP FUNCTION IF EXISTS pools_admit{v}(bigint[], timestamptz, double precision, boolean);
DROP FUNCTION IF EXISTS pools_out{v}(
    text, bigint, text, bigint, text, text, jsonb, jsonb, jsonb, jsonb, text, text, bigint,
    bigint, timestamptz, bigint, text, jsonb
);
"""


def _create(version: int) -> Any:
    def run(apps: Any, schema_editor: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            with schema_editor.connection.cursor() as cursor:
                cursor.execute((SQL_DIR / f"admission_v{version}.sql").read_text())

    return run


def _drop_version(version: int) -> Any:
    def run(apps: Any, schema_editor: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            with schema_editor.connection.cursor() as cursor:
                cursor.execute(_drop(version))

    return run


class Migration(migrations.Migration):
    dependencies = [("pools", "0017_pool_rates")]

    operations = [migrations.RunPython(_create(7), _drop_version(7))]
