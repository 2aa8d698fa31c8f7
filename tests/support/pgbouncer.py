"""The PgBouncer of ``make test-pgbouncer`` (``scripts/pgbouncer/``), seen from the tests.

``POOLS_PG_POOLER=transaction`` with ``POOLS_PG_PORT`` = PgBouncer's port routes the
test database connections, and the workers', through it (``tests/settings.py``). Its
admin console (database ``pgbouncer``, simple query protocol only) says what it holds.
"""

from __future__ import annotations

import os
from typing import Any

from django.conf import settings

#: True when the suite runs through a transaction pooler.
ACTIVE = os.environ.get("POOLS_PG_POOLER") == "transaction"


def port() -> int:
    """The port the test database connections go to (PgBouncer's, when :data:`ACTIVE`)."""
    return int(str(settings.DATABASES["default"].get("PORT") or 5432))


def admin(command: str) -> list[dict[str, Any]]:
    """Rows of one admin console command (``SHOW POOLS``, ``SHOW CONFIG``...) as dicts."""
    import psycopg

    with psycopg.connect(
        host="127.0.0.1", port=port(), dbname="pgbouncer", user="postgres", autocommit=True
    ) as conn:
        cursor = psycopg.ClientCursor(conn)  # the console speaks the simple protocol only
        cursor.execute(command)
        if cursor.description is None:
            return []
        names = [c.name for c in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def release(database: str) -> None:
    """Close PgBouncer's server connections to ``database`` (so it can be dropped).

    ``KILL`` also drops its client connections and pauses the database; ``RESUME`` lets
    new clients in again.
    """
    if any(row["name"] == database for row in admin("SHOW DATABASES")):
        admin(f'KILL "{database}"')
        admin(f'RESUME "{database}"')


def setting(name: str) -> str:
    """One value of PgBouncer's running configuration (``SHOW CONFIG``)."""
    for row in admin("SHOW CONFIG"):
        if row["key"] == name:
            return str(row["value"])
    raise KeyError(name)
