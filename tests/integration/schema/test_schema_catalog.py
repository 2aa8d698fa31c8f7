"""One schema, however a database got it: the catalog of PostgreSQL compared three ways.

(a) A new database migrated by this tree; (b) one migrated by the previous release's tree
(``tests.upgrade.run.PRE_SQUASH``, the last commit before the migrations were squashed: its
own migration chain, from ``git archive``) and then by this tree. Their
``pg_dump --schema-only`` must be equal — tables with their columns in order, indexes,
constraints, storage parameters, functions — except the functions of the version before
the current one, which the old chain kept for the previous release's processes (expand)
and (b) alone may hold. And (a) must be (b) in Django's eyes: this tree's ``migrate`` on (b)
plans nothing for ``pools`` and records the initial migration as applied.

(c) The functions of (a) equal those of an empty database that loaded the baseline (the
file the initial migration runs) and then every delta in order, and those of an empty
database that loaded ``schema.sql`` alone: ``schema.sql`` is the current state.

Databases ``squash_*`` on the server under test, dropped afterwards. PostgreSQL, git
history and ``pg_dump`` missing: skipped locally, failed under ``CI=true``.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.apps import apps

from pools.pg import functions, sqlfile
from tests.conftest import IN_CI, require_previous_release
from tests.upgrade import run

pytestmark = [pytest.mark.postgres]

FRESH = "squash_fresh"
UPGRADED = "squash_upgraded"
BASELINE = "squash_baseline"
SCHEMA = "squash_schema"
PORT = os.environ.get("POOLS_PG_PORT", "5432")
INITIAL = "0001_release_0_1_0"
#: The functions (b) may hold beyond (a): those of earlier versions (the old chain kept
#: each for one release; the next release's delta drops them).
LEFTOVER = re.compile(rf"pools_[a-z_]+_v(?!{functions.VERSION}\()\d+\(")
#: A stored routine of the version this code calls.
CURRENT = re.compile(rf"pools_[a-z_]+_v{functions.VERSION}\(")
_HEADER = re.compile(r"^-- Name: (.*); Type: (.*); Schema: (.*); Owner: .*$")


def _missing(message: str) -> None:
    if IN_CI:
        pytest.fail(f"{message} (CI=true: the catalog test must run)")
    pytest.skip(message)


def _admin(sql: str) -> list[tuple[object, ...]]:
    import psycopg

    with psycopg.connect(
        host="127.0.0.1", port=PORT, user="postgres", dbname="postgres", autocommit=True
    ) as conn:
        cur = conn.execute(sql.encode())
        return cur.fetchall() if cur.description else []


def _recreate(name: str) -> None:
    _admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    _admin(f"CREATE DATABASE {name}")


def _execute(database: str, sql: str) -> list[tuple[object, ...]]:
    import psycopg

    with psycopg.connect(
        host="127.0.0.1", port=PORT, user="postgres", dbname=database, autocommit=True
    ) as conn:
        cur = conn.execute(sql.encode())
        return cur.fetchall() if cur.description else []


def _manage(tree: Path, database: str, *args: str) -> str:
    """``django-admin <args>`` with ``tree``'s code on ``database``."""
    return run.manage(tree, *args, env=run.env_for(tree, POOLS_PG_NAME=database))


def dump(database: str) -> dict[str, str]:
    """``pg_dump --schema-only`` as {object header: its statements}, comments, blank lines
    and the random key of ``\\restrict`` (pg_dump >= 15.14) left out (the order of
    objects is pg_dump's own: by kind and name)."""
    text = subprocess.run(
        ["pg_dump", "--schema-only", "-h", "127.0.0.1", "-p", PORT, "-U", "postgres", database],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    blocks: dict[str, str] = {}
    key = ""
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            key = "; ".join(header.groups())
            blocks[key] = ""
        elif key and line.strip() and not line.startswith(("--", "\\restrict", "\\unrestrict")):
            blocks[key] += line + "\n"
    return blocks


def differences(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """What differs between two dumps, one line an object."""
    only_a = [f"only in the first: {k}" for k in a if k not in b]
    only_b = [f"only in the second: {k}" for k in b if k not in a]
    changed = [f"differs: {k}" for k in a if k in b and a[k] != b[k]]
    return only_a + only_b + changed


def stored_functions(database: str) -> dict[str, str]:
    """{signature: definition} of the pools functions of a database."""
    rows = _execute(
        database,
        "SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid) FROM pg_proc p "
        "WHERE p.pronamespace = 'public'::regnamespace AND p.proname LIKE 'pools\\_%'",
    )
    return {str(sig): str(body) for sig, body in rows}


def _baseline() -> str:
    return str(importlib.import_module(f"pools.migrations.{INITIAL}").BASELINE)


@pytest.fixture(scope="module")
def databases(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The four databases built; yields what this tree's ``migrate --plan`` said on (b)."""
    if shutil.which("pg_dump") is None:
        _missing("pg_dump is not installed (apt-get install postgresql-client)")
    require_previous_release()
    old = tmp_path_factory.mktemp("previous")
    run.export_tree(run.PRE_SQUASH, old)
    try:
        for name in (FRESH, UPGRADED, BASELINE, SCHEMA):
            _recreate(name)
        _manage(run.ROOT, FRESH, "migrate", "--noinput")
        _manage(old, UPGRADED, "migrate", "--noinput")
        plan = _manage(run.ROOT, UPGRADED, "migrate", "--plan")
        _manage(run.ROOT, UPGRADED, "migrate", "--noinput")
        # Function bodies are checked when a migration runs them against the tables (a);
        # here the files alone are loaded, before any table exists.
        unchecked = "SET check_function_bodies = off;\n"
        for path in (_baseline(), *sqlfile.deltas()):
            _execute(BASELINE, unchecked + sqlfile.read(path))
        _execute(SCHEMA, unchecked + sqlfile.read("schema.sql"))
        yield {"plan": plan}
    finally:
        for name in (FRESH, UPGRADED, BASELINE, SCHEMA):
            _admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_schema_catalog__a_database_of_the_old_chain_counts_as_migrated(
    databases: dict[str, str],
) -> None:
    planned = re.findall(r"^(\w+)\.(\w+)$", databases["plan"], flags=re.M)
    # The old chain counts as the initial migration: only the later ones are planned.
    later = run.later_migrations()
    assert [m for app, m in planned if app == "pools"] == later, databases["plan"]
    applied = _execute(
        UPGRADED, "SELECT name FROM django_migrations WHERE app = 'pools' ORDER BY name"
    )
    names = [str(name) for (name,) in applied]
    assert INITIAL in names, names
    # The 18 it replaces, recorded by the old release, and the later ones, applied since.
    assert len(names) == 19 + len(later), names


def test_schema_catalog__fresh_and_upgraded_databases_have_one_schema(
    databases: dict[str, str],
) -> None:
    fresh, upgraded = dump(FRESH), dump(UPGRADED)
    leftovers = [k for k in upgraded if k not in fresh and LEFTOVER.match(k)]
    assert all("; FUNCTION; " in k for k in leftovers), leftovers
    for key in leftovers:
        del upgraded[key]
    assert not differences(fresh, upgraded), differences(fresh, upgraded)
    # What the comparison covers (a dump that lost them would compare equal, vacuously).
    tables = [k for k in fresh if k.startswith("pools_") and "; TABLE; " in k]
    assert len(tables) == len(list(apps.get_app_config("pools").get_models())), tables
    assert "fillfactor='80'" in fresh["pools_queueentry; TABLE; public"]
    assert sum("; INDEX; " in k and k.startswith("pools_") for k in fresh) >= 10
    assert sum(bool(CURRENT.match(k)) for k in fresh) == len(functions.BASES)


def test_schema_catalog__self_test_a_difference_is_reported(databases: dict[str, str]) -> None:
    """The comparison can fail: a storage parameter, a column's place, a missing index."""
    fresh = dump(FRESH)
    table = "pools_queueentry; TABLE; public"
    lines = fresh[table].splitlines(keepends=True)
    swapped = [lines[0], lines[2], lines[1], *lines[3:]]
    for changed in (
        {**fresh, table: fresh[table].replace("fillfactor='80'", "fillfactor='90'")},
        {**fresh, table: "".join(swapped)},
        {k: v for k, v in fresh.items() if not k.startswith("pools_entry_job;")},
    ):
        assert differences(fresh, changed)


def test_schema_catalog__baseline_and_deltas_make_schema_sql(databases: dict[str, str]) -> None:
    """The migrations, the baseline plus the deltas, and schema.sql alone make the same
    routines of the current version; the migrations keep the baseline's older ones (for
    the previous release's processes during a deploy) and nothing else."""
    migrated = stored_functions(FRESH)
    current = {k: v for k, v in migrated.items() if CURRENT.match(k)}
    assert sorted(s.split("(")[0] for s in current) == sorted(
        functions.name(b) for b in functions.BASES
    )
    older = {k: v for k, v in migrated.items() if k not in current}
    assert all(LEFTOVER.match(k) for k in older), sorted(older)
    assert stored_functions(BASELINE) == migrated
    assert stored_functions(SCHEMA) == current
