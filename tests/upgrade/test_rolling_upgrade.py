"""A rolling deploy from the previous release to this tree loses nothing and runs nothing
twice (``tests/upgrade/run.py`` has the steps and the figures), and its sabotage twin: a
tree whose next release drops the previous release's stored functions in the migration
that creates the new ones (a contract in the same step) fails the same check.

Real PostgreSQL, Redis and prefork workers of both releases; the previous release's code
comes from this checkout's git history. The same deploy on MariaDB/MySQL (the ORM path,
database ``mdb_upgrade``), whatever database the session's own tests use.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pools.pg import sqlfile
from tests.conftest import IN_CI, require_previous_release
from tests.upgrade import run

pytestmark = [pytest.mark.redis, pytest.mark.upgrade]

#: The sabotage's delta and its migration (paths in the copied tree).
DELTA = Path("pools") / "pg" / "sql" / "deltas" / "0.2.1_contract_now.sql"
MIGRATION = Path("pools") / "migrations" / "9998_contract_now.py"


def _baseline() -> str:
    """The SQL file the initial migration runs (the 0.1.0 baseline)."""
    import importlib

    return str(importlib.import_module("pools.migrations.0001_release_0_1_0").BASELINE)


def _leaf(tree: Path) -> str:
    """The latest pools migration of ``tree`` (a new one depends on it)."""
    migrations = tree / "pools" / "migrations"
    return sorted(m.stem for m in migrations.glob("[0-9][0-9][0-9][0-9]_*.py"))[-1]


#: What this tree's ``migrate`` applies to the previous release's database before any
#: migration a sabotage adds.
LATER = [f"pools.{name}" for name in run.later_migrations()]


@pytest.fixture(autouse=True)
def _own_broker(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run sets Celery's broker variables to its own Redis databases: restored after."""
    monkeypatch.setenv("CELERY_BROKER_URL", run.BROKER)
    monkeypatch.setenv("CELERY_RESULT_BACKEND", run.BACKEND)


@pytest.fixture(autouse=True)
def _history() -> None:
    require_previous_release()


@pytest.fixture
def mariadb() -> None:
    """A MariaDB/MySQL server to upgrade on (skipped locally without one, failed in CI)."""
    import MySQLdb

    try:
        run.mysql_server().close()
    except MySQLdb.OperationalError as exc:
        if IN_CI:
            pytest.fail(f"no MariaDB/MySQL server for the upgrade test: {exc}")
        pytest.skip(f"no MariaDB/MySQL server: {exc}")


@pytest.mark.postgres
def test_rolling_upgrade__calls_in_flight_run_once_and_nothing_is_refused(tmp_path: Path) -> None:
    figures = run.run(workdir=tmp_path)
    assert not figures.missed(), figures.missed()
    assert figures.calls >= 150 and figures.old_worker_exit == 0, figures


def test_rolling_upgrade__on_mariadb_calls_in_flight_run_once_and_nothing_is_refused(
    tmp_path: Path, mariadb: None
) -> None:
    figures = run.run(workdir=tmp_path, database="mysql")
    assert not figures.missed(), figures.missed()
    assert figures.calls >= 150 and figures.old_worker_exit == 0, figures


@pytest.mark.postgres
def test_rolling_upgrade__self_test_a_contract_in_the_same_step_is_caught(tmp_path: Path) -> None:
    """The check can fail: a release that drops the previous release's stored functions in
    its own migrations (contract in the same step as expand) refuses the old release's
    calls and stalls its settles. The previous release's functions are those the 0.1.0
    baseline creates."""
    tree = _copy(tmp_path)
    previous = sqlfile.created_functions(sqlfile.read(_baseline()))
    (tree / DELTA).write_text(sqlfile.drop_all(previous))
    leaf = _leaf(tree)
    (tree / MIGRATION).write_text(
        "from django.db import migrations\n\nfrom pools.pg import sqlfile\n\n\n"
        "class Migration(migrations.Migration):\n"
        f'    dependencies = [("pools", "{leaf}")]\n'
        f'    operations = [sqlfile.run("deltas/{DELTA.name}")]\n'
    )
    figures = run.run(workdir=tmp_path / "run", new=tree)
    assert figures.planned == [*LATER, "pools.9998_contract_now"], figures.planned
    assert figures.refused, figures
    enqueue = next(name for name in previous if name.startswith("pools_enqueue_v"))
    assert any(enqueue in line for line in figures.refused), figures.refused[:3]


#: The sabotage of the MariaDB run: a column the new release fills, ``NOT NULL`` without a
#: database default (Django's ``AddField`` drops the default it adds with the column).
NOT_NULL_FIELD = "    tenant = models.IntegerField(default=0)\n"
NOT_NULL_MIGRATION = """from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("pools", "{leaf}")]
    operations = [
        migrations.AddField("queueentry", "tenant", models.IntegerField(default=0)),
    ]
"""


def test_rolling_upgrade__on_mariadb_self_test_a_not_null_column_is_caught(
    tmp_path: Path, mariadb: None
) -> None:
    """The check can fail on MariaDB too: a new release whose migration adds a ``NOT NULL``
    column without a database default (not expand/contract) makes the previous release's
    web process fail every call once ``migrate`` has run."""
    tree = _copy(tmp_path)
    models = tree / "pools" / "models.py"
    text = models.read_text()
    anchor = "    objects = QueueEntryQuerySet.as_manager()\n"
    assert anchor in text
    models.write_text(text.replace(anchor, NOT_NULL_FIELD + anchor, 1))
    migrations = tree / "pools" / "migrations"
    (migrations / "9999_not_null_tenant.py").write_text(NOT_NULL_MIGRATION.format(leaf=_leaf(tree)))
    figures = run.run(workdir=tmp_path / "run", new=tree, database="mysql")
    assert figures.planned == [*LATER, "pools.9999_not_null_tenant"], figures.planned
    assert any("tenant" in line for line in figures.refused), figures.refused[:3]
    print(f"\nsabotaged deploy on MariaDB: {len(figures.refused)} of {figures.calls} calls refused")


def _copy(tmp_path: Path) -> Path:
    """This checkout's tree (no git, venvs or caches), to sabotage."""
    tree = tmp_path / "sabotaged"
    shutil.copytree(
        run.ROOT,
        tree,
        ignore=shutil.ignore_patterns(".git", ".venv*", ".cache", ".site", "node_modules", "*.pyc"),
    )
    return tree
