"""On MariaDB/MySQL too, the squashed initial migration builds what the old chain built.

Two databases, one migrated by the previous release's tree (``tests.upgrade.run.PRE_SQUASH``:
its 18 migrations) and one by this tree: every ``pools_`` table's ``SHOW CREATE TABLE``
(columns in order, types, defaults, indexes in any order, foreign keys; the
auto-increment counter left out) is the same, and this tree's ``migrate`` on the old database applies nothing.
Run by ``make test-mariadb``; git history missing: skipped locally, failed under ``CI=true``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require_previous_release
from tests.upgrade import run

pytestmark = pytest.mark.mysql

DATABASES = ("pools_squash_old", "pools_squash_new")


def _connect() -> Any:
    import MySQLdb

    return MySQLdb.connect(host="127.0.0.1", user="root", passwd="", port=3306)


@pytest.fixture
def databases() -> Iterator[None]:
    conn = _connect()
    try:
        with conn.cursor() as cursor:
            for name in DATABASES:
                cursor.execute(f"DROP DATABASE IF EXISTS {name}")
                cursor.execute(f"CREATE DATABASE {name} CHARACTER SET utf8mb4")
        yield
        with conn.cursor() as cursor:
            for name in DATABASES:
                cursor.execute(f"DROP DATABASE IF EXISTS {name}")
    finally:
        conn.close()


def _migrate(tree: Path, database: str, *args: str) -> str:
    env = run.env_for(tree, POOLS_TEST_DB="mysql", POOLS_MYSQL_NAME=database)
    return run.manage(tree, "migrate", *args, env=env)


def _tables(database: str) -> dict[str, str]:
    conn = _connect()
    try:
        with conn.cursor() as cursor:
            cursor.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = %s "
                "AND table_name LIKE 'pools\\_%%' ORDER BY table_name",
                (database,),
            )
            names = [str(row[0]) for row in cursor.fetchall()]
            shown = {}
            for name in names:
                cursor.execute(f"SHOW CREATE TABLE {database}.{name}")
                ddl = str(cursor.fetchone()[1])
                shown[name] = _normalised(ddl)
            return shown
    finally:
        conn.close()


def _normalised(ddl: str) -> str:
    """``SHOW CREATE TABLE`` without the auto-increment counter, secondary indexes sorted
    (MariaDB lists them in creation order, which differs between the two histories)."""
    lines = re.sub(r" AUTO_INCREMENT=\d+", "", ddl).splitlines()
    keys = sorted(line.rstrip(",") for line in lines if line.startswith("  KEY "))
    rest = [line.rstrip(",") for line in lines if not line.startswith("  KEY ")]
    return "\n".join(rest + keys)


def test_schema_mysql__the_old_chain_and_the_squashed_migration_build_one_schema(
    tmp_path: Path, databases: None
) -> None:
    require_previous_release()
    old_tree = tmp_path / "previous"
    run.export_tree(run.PRE_SQUASH, old_tree)
    _migrate(old_tree, DATABASES[0], "--noinput")
    _migrate(run.ROOT, DATABASES[1], "--noinput")
    # This tree's migrate on the old database applies the later migrations alone.
    plan = _migrate(run.ROOT, DATABASES[0], "--plan")
    assert run.planned_pools_migrations(plan) == run.LATER, plan
    _migrate(run.ROOT, DATABASES[0], "--noinput")
    old, new = _tables(DATABASES[0]), _tables(DATABASES[1])
    assert len(new) == 8, sorted(new)
    differ = {name: (old.get(name), new.get(name)) for name in old.keys() | new.keys()}
    differ = {name: pair for name, pair in differ.items() if pair[0] != pair[1]}
    assert not differ, differ
    plan = _migrate(run.ROOT, DATABASES[0], "--plan")
    assert "No planned migration operations." in plan, plan
