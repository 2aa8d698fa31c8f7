"""Migration operations that run a file of ``pools/pg/sql/`` on PostgreSQL.

The initial migration runs the 0.1.0 baseline; each later change to the stored functions
is a delta file (``pools/pg/sql/deltas/<release>_<topic>.sql``) run by a migration of one
line: ``operations = [sqlfile.run("deltas/0.2.0_topic.sql")]``. Nothing runs on other
databases (they use the ORM path). The whole file is sent as one string, as written:
comments inside function bodies are stored with the functions, so a database that ran a
file and one that ran the same text another way hold the same functions.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from django.db import migrations

#: Where the SQL files are.
SQL_DIR = Path(__file__).resolve().parent / "sql"

_CREATED = re.compile(
    r"^CREATE\s+(?:OR\s+REPLACE\s+)?(?:FUNCTION|PROCEDURE)\s+(\w+)\s*\(", re.I | re.M
)


def read(path: str) -> str:
    """The text of ``pools/pg/sql/<path>``."""
    return (SQL_DIR / path).read_text()


def deltas() -> list[str]:
    """The delta files (paths under ``pools/pg/sql/``) in the order their migrations run
    them (a delta no migration runs last, by release then name): the catalog test loads
    them so, after the baseline, to rebuild what the migrations build."""
    runs = {
        found: migration.name
        for migration in sorted((SQL_DIR.parent.parent / "migrations").glob("0*.py"))
        for found in re.findall(r'sqlfile\.run\(\s*"(deltas/[^"]+)"', migration.read_text())
    }

    def order(path: Path) -> tuple[str, tuple[int, ...], str]:
        found = re.match(r"(\d+(?:\.\d+)*)_", path.name)
        release = tuple(int(x) for x in found.group(1).split(".")) if found else ()
        return runs.get(f"deltas/{path.name}", "~"), release, path.name

    return [f"deltas/{p.name}" for p in sorted((SQL_DIR / "deltas").glob("*.sql"), key=order)]


def created_functions(sql: str) -> list[str]:
    """The names of the functions and procedures a SQL text creates, in order of appearance."""
    return list(dict.fromkeys(_CREATED.findall(sql)))


def _on_postgresql(schema_editor: Any, sql: str) -> None:
    if schema_editor.connection.vendor == "postgresql":
        with schema_editor.connection.cursor() as cursor:
            cursor.execute(sql)


def drop_all(names: list[str]) -> str:
    """A statement dropping every overload of the named functions (in the current schema)."""
    quoted = ", ".join(f"'{n}'" for n in names)
    return f"""
DO $$
DECLARE f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
             WHERE p.pronamespace = current_schema()::regnamespace
               AND p.proname IN ({quoted})
    LOOP
        EXECUTE 'DROP ROUTINE ' || f;
    END LOOP;
END $$;
"""


def run(path: str, reverse: str | None = None) -> migrations.RunPython:
    """Run ``pools/pg/sql/<path>`` on PostgreSQL; backwards, run ``reverse`` (a path
    there) or, without one, drop the functions ``path`` creates."""

    def forwards(apps: Any, schema_editor: Any) -> None:
        _on_postgresql(schema_editor, read(path))

    def backwards(apps: Any, schema_editor: Any) -> None:
        sql = read(reverse) if reverse else drop_all(created_functions(read(path)))
        _on_postgresql(schema_editor, sql)

    return migrations.RunPython(forwards, backwards)


def set_fillfactor(table: str, percent: int) -> migrations.RunPython:
    """``ALTER TABLE ... SET (fillfactor = percent)`` on PostgreSQL (nothing elsewhere):
    room on each page for HOT updates. Backwards sets it back to the default (100)."""

    def run_with(value: int) -> Any:
        def go(apps: Any, schema_editor: Any) -> None:
            quoted = schema_editor.quote_name(table)
            _on_postgresql(schema_editor, f"ALTER TABLE {quoted} SET (fillfactor = {int(value)})")

        return go

    return migrations.RunPython(run_with(percent), run_with(100))
