"""Shipped SQL never changes, and the code calls the functions of one version.

The initial migration runs one file of ``pools/pg/sql/`` (``BASELINE`` in it; today
``schema.sql``, which 0.1.0 ships), and each later change is a delta file
(``pools/pg/sql/deltas/<release>_<topic>.sql``) run by a migration. Databases have already
run those files, so editing one would make fresh installs and upgraded ones run different
functions under one name: each is pinned here by sha256. How to change the SQL:
docs/howto/sql-changes.md.
"""

from __future__ import annotations

import hashlib
import importlib
import re
from pathlib import Path

import pytest

import pools
from pools.pg import functions, sqlfile

PACKAGE = Path(pools.__file__).resolve().parent
TESTS = Path(__file__).resolve().parents[1]
SQL_DIR = sqlfile.SQL_DIR
INITIAL = "0001_release_0_1_0"

#: sha256 of the file the initial migration runs, and of every shipped delta (by path
#: under pools/pg/sql/).
PINNED = {
    "baseline-0.1.0.sql": "559ed9dc40c5f9f58983e54906bf670e662b70c926bfc7e2bef590b37227955d",
    "deltas/0.2.0_contention.sql": "45058c454d2f11c9cdb9a3404f87ebe126f10b9b6f4aaa3d0007de474b7474cb",
    "deltas/0.2.0_owed_slots.sql": "1757368f2b298770ce3ebceb49b483349a53c484905f46b036756edf62b66872",
    "deltas/0.2.0_backoff_ended.sql": "61e09b8cce6678224d9abe6ab55e3e7572120157d063ba90604f5bcfe924d7fa",
    "deltas/0.2.0_rated_start.sql": "b5827a4b82fc7ffbbf878873cd5cb02b481a5f31dbd6eb0ce2237b2087a20791",
}

FREEZE = (
    "{name} is the file the initial migration runs (0.1.0 shipped it): it never changes. "
    "To change the SQL, first freeze it: `git show <last release tag>:pools/pg/sql/{name} "
    "> pools/pg/sql/baseline-0.1.0.sql`, set BASELINE = 'baseline-0.1.0.sql' in "
    "pools/migrations/{initial}.py and move this pin to that file; then edit schema.sql and "
    "write the same change as deltas/<next version>_<topic>.sql with a one-line migration "
    "(docs/howto/sql-changes.md)."
)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def baseline() -> str:
    """The file (under pools/pg/sql/) the initial migration runs."""
    return str(importlib.import_module(f"pools.migrations.{INITIAL}").BASELINE)


def test_sql_versions__the_baseline_is_unchanged() -> None:
    name = baseline()
    assert name in PINNED, f"pin the sha256 of {name}, the file the initial migration runs"
    assert _digest(SQL_DIR / name) == PINNED[name], FREEZE.format(name=name, initial=INITIAL)


def test_sql_versions__shipped_deltas_are_unchanged_and_pinned() -> None:
    files = sqlfile.deltas()
    changed = [d for d in files if d in PINNED and _digest(SQL_DIR / d) != PINNED[d]]
    assert not changed, (
        f"shipped deltas changed: {changed}. A shipped delta never changes: write the fix "
        "as a new delta (deltas/README.md)."
    )
    unpinned = [d for d in files if d not in PINNED]
    assert not unpinned, f"pin the sha256 of {unpinned} in PINNED"
    gone = sorted(set(PINNED) - {baseline(), *files})
    assert not gone, f"pinned SQL files are gone: {gone} (a shipped file is never deleted)"


def test_sql_versions__deltas_are_named_by_release_and_each_is_run_by_a_migration() -> None:
    migrations = {m.name: m.read_text() for m in (PACKAGE / "migrations").glob("0*.py")}
    order = []
    for delta in sqlfile.deltas():
        assert re.fullmatch(r"deltas/\d+\.\d+\.\d+_[a-z0-9_]+\.sql", delta), delta
        runners = [name for name, text in migrations.items() if f'sqlfile.run("{delta}"' in text]
        assert len(runners) == 1, f"{delta} must be run by exactly one migration"
        order += runners
    # In the order the migrations run them (0.2.0_backoff_ended after 0.2.0_owed_slots).
    assert order == sorted(order)


def test_sql_versions__schema_creates_every_function_with_the_version_suffix() -> None:
    created = sqlfile.created_functions(sqlfile.read("schema.sql"))
    assert sorted(created) == sorted(functions.name(b) for b in functions.BASES), created


def test_sql_versions__deltas_create_functions_of_a_version_up_to_the_current_one() -> None:
    last: list[str] = []
    for delta in sqlfile.deltas():
        created = sqlfile.created_functions(sqlfile.read(delta))
        for fn in created:
            found = re.fullmatch(r"pools_([a-z_]+)_v(\d+)", fn)
            assert found and found.group(1) in functions.BASES, f"{delta}: {fn}"
            assert int(found.group(2)) <= functions.VERSION, f"{delta}: {fn} after VERSION"
        last = created or last
    # The newest delta that creates functions creates those the code calls.
    assert all(fn.endswith(f"_v{functions.VERSION}") for fn in last), last


def test_sql_versions__python_names_the_functions_through_the_constant() -> None:
    """No Python file but pools/pg/functions.py spells a versioned function name."""
    literal = re.compile(r"pools_[a-z]+_v\d+")
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{n}"
        for root in (PACKAGE, PACKAGE.parent / "pools_admin", TESTS)
        for path in root.rglob("*.py")
        if path != PACKAGE / "pg" / "functions.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if literal.search(line)
    ]
    assert not found, f"use pools.pg.functions.name(...) instead of a literal name: {found}"


def test_sql_versions__name_is_the_version_suffix() -> None:
    assert functions.name("admit") == f"pools_admit_v{functions.VERSION}"
    with pytest.raises(ValueError, match="no stored function"):
        functions.name("admitt")
