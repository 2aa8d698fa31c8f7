"""A test that needs a database server skips locally and fails under CI when it is gone.

Runs pytest in a subprocess against MariaDB/MySQL on a port where nothing listens
(part of ``make test-mariadb``: marked ``mysql``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.mysql

PROBE = "tests/integration/checks/test_checks_mysql.py::test_checks__the_test_settings_pass"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(ci: bool) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "POOLS_TEST_DB": "mysql",
        "POOLS_MYSQL_PORT": str(_free_port()),
        "CI": "true" if ci else "",
    }
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", PROBE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("ci", [False, True])
def test_missing_mariadb__skips_locally_and_fails_under_ci(ci: bool) -> None:
    pytest.importorskip("MySQLdb")
    run = _run(ci)
    out = run.stdout + run.stderr
    if ci:
        assert run.returncode != 0, out
        assert "CI=true: a missing service is a failure" in out, out
        assert "skipped" not in out.splitlines()[-1], out
    else:
        assert run.returncode == 0, out
        assert "1 skipped" in out.splitlines()[-1], out
