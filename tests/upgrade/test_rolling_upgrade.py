"""A rolling deploy from the previous release to this tree loses nothing and runs nothing
twice (``tests/upgrade/run.py`` has the steps and the figures), and its sabotage twin: a
tree whose migration drops the previous release's stored functions in the step that
creates the new ones fails the same check.

Real PostgreSQL, Redis and prefork workers of both releases; the previous release's code
comes from this checkout's git history.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import IN_CI
from tests.upgrade import run

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.upgrade]

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


def test_rolling_upgrade__calls_in_flight_run_once_and_nothing_is_refused(tmp_path: Path) -> None:
    figures = run.run(workdir=tmp_path)
    assert not figures.missed(), figures.missed()
    assert figures.calls >= 150 and figures.old_worker_exit == 0, figures


def test_rolling_upgrade__self_test_a_contract_in_the_same_step_is_caught(tmp_path: Path) -> None:
    """The check can fail: dropping version 6 where version 7 is created (what the release
    did before expand/contract) refuses the old release's calls and stalls its settles."""
    tree = tmp_path / "sabotaged"
    shutil.copytree(
        run.ROOT,
        tree,
        ignore=shutil.ignore_patterns(".git", ".venv*", ".cache", ".site", "node_modules", "*.pyc"),
    )
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
