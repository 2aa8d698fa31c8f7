"""On SQLite too, the squashed initial migration builds what the old chain built.

A database migrated by the previous release's tree (``tests.upgrade.run.PRE_SQUASH``: its
18 migrations, from ``git archive``) and one migrated by this tree have the same
``sqlite_master``: every table (with its columns in order), index and constraint, as the
SQL SQLite keeps for it. Then this tree's ``migrate`` on the old database applies the later migrations
(``run.LATER``) alone, and after them nothing.
No server needed; git history missing: skipped locally, failed under ``CI=true``.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from tests.conftest import require_previous_release
from tests.upgrade import run


def _migrate(tree: Path, directory: Path, *args: str) -> str:
    env = run.env_for(tree, POOLS_TEST_DB="sqlite", POOLS_SQLITE_DIR=str(directory))
    return run.manage(tree, "migrate", *args, env=env)


def _master(directory: Path) -> list[tuple[str, str, str]]:
    with sqlite3.connect(directory / "pools-tests.sqlite3") as conn:
        rows = conn.execute("SELECT type, name, sql FROM sqlite_master ORDER BY type, name")
        return [(str(t), str(n), str(s)) for t, n, s in rows]


def test_schema_sqlite__the_old_chain_and_the_squashed_migration_build_one_schema(
    tmp_path: Path,
) -> None:
    require_previous_release()
    old_tree, old_db, new_db = tmp_path / "previous", tmp_path / "old", tmp_path / "new"
    for directory in (old_db, new_db):
        directory.mkdir()
    run.export_tree(run.PRE_SQUASH, old_tree)
    _migrate(old_tree, old_db, "--noinput")
    _migrate(run.ROOT, new_db, "--noinput")
    # This tree's migrate on the old database applies the later migrations alone.
    plan = _migrate(run.ROOT, old_db, "--plan")
    assert run.planned_pools_migrations(plan) == run.LATER, plan
    _migrate(run.ROOT, old_db, "--noinput")
    old, new = _master(old_db), _master(new_db)
    assert [r for r in old if r not in new] == [] and [r for r in new if r not in old] == []
    assert sum(1 for t, n, _ in new if t == "table" and n.startswith("pools_")) == 8
    plan = _migrate(run.ROOT, old_db, "--plan")
    assert "No planned migration operations." in plan, plan
