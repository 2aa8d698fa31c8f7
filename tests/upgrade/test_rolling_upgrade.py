"""A rolling deploy from the previous release to this tree loses nothing and runs nothing
twice (``tests/upgrade/run.py`` has the steps and the figures), and its sabotage twin: a
tree whose migration drops the previous release's stored functions in the step that
creates the new ones fails the same check.

Real PostgreSQL, Redis and prefork workers of both releases; the previous release's code
comes from this checkout's git history. The same deploy on MariaDB/MySQL (the ORM path,
database ``mdb_upgrade``), whatever database the session's own tests use.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import IN_CI
from tests.upgrade import run

pytestmark = [pytest.mark.redis, pytest.mark.upgrade]

MIGRATION = Path("pools") / "migrations" / "0018_fastpath_rates.py"
EXPAND_ONLY = "operations = [migrations.RunPython(_create(7), _drop_version(7))]"


@pytest.fixture(autouse=True)
def _own_broker(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run sets Celery's broker variables to its own Redis databases: restored after."""
    monkeypatch.setenv("CELERY_BROKER_URL", run.BROKER)
    monkeypatch.setenv("CELERY_RESULT_BACKEND", run.BACKEND)


@pytest.fixture(autouse=True)
def _history() -> None:
    found = subprocess.run(
        ["git", "cat-file", "-e", f"{run.PREVIOUS}^{{commit}}"], cwd=run.ROOT, check=False
    )
    if found.returncode != 0:
        message = f"the previous release {run.PREVIOUS} is not in this checkout's git history"
        if IN_CI:
            pytest.fail(message + " (CI=true: the upgrade test must run)")
        pytest.skip(message)


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
    """The check can fail: dropping version 6 where version 7 is created (what the release
    did before expand/contract) refuses the old release's calls and stalls its settles."""
    tree = _copy(tmp_path)
    migration = tree / MIGRATION
    text = migration.read_text()
    assert EXPAND_ONLY in text
    contract_now = (
        "operations = [migrations.RunPython(_create(7)), migrations.RunPython(_drop_version(6))]"
    )
    migration.write_text(text.replace(EXPAND_ONLY, contract_now))
    figures = run.run(workdir=tmp_path / "run", new=tree)
    assert figures.refused, figures
    assert any("pools_enqueue_v6" in line for line in figures.refused), figures.refused[:3]


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
    leaf = sorted(m.stem for m in migrations.glob("[0-9][0-9][0-9][0-9]_*.py"))[-1]
    (migrations / "9999_not_null_tenant.py").write_text(NOT_NULL_MIGRATION.format(leaf=leaf))
    figures = run.run(workdir=tmp_path / "run", new=tree, database="mysql")
    assert "9999_not_null_tenant" in figures.unapplied_before_migrate, figures
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
