"""The bounded chaos runs of ``make test``: 2,000 pooled tasks, 20 faults of every kind;
then 400 with typed arguments among them, under process faults only.

It restarts PostgreSQL and Redis on this machine, so it runs in its own tier
(``make test-chaos``), never next to other tests. ``python -m tests.chaos.run --help``
scales it up for a long soak (``--tasks 20000 --faults 200``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.chaos]


def test_chaos__promises_hold_under_twenty_faults() -> None:
    seed = os.environ.get("CHAOS_SEED", "20261203")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.chaos.run", "--seed", seed, "--tasks", "2000",
         "--faults", "20", "--strict-drain"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    print(proc.stdout[-6000:], proc.stderr[-4000:], sep="\n")
    summary = [line for line in proc.stdout.splitlines() if line.startswith("chaos: ")]
    assert summary, "the runner printed no summary line"
    assert proc.returncode == 0, summary[-1]
    assert "lost entries 0;" in summary[-1] and "results not final 0;" in summary[-1]
    assert "starved heads 0 (" in summary[-1]


def test_chaos__typed_arguments_come_back_as_sent_under_process_faults() -> None:
    """Calls whose arguments are dates, datetimes (aware and naive), UUIDs, Decimals and
    bytes, nested and in kwargs, through a busy pool while workers are SIGKILLed and
    paused: each returns exactly what it was sent, and no admission goes unpublished (an
    entry admitted again more often than the process faults explain fails the run; the
    sweep would otherwise hide such a stall as a lease-long delay)."""
    seed = os.environ.get("CHAOS_SEED", "34")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.chaos.run", "--seed", seed, "--tasks", "400",
         "--faults", "6", "--kinds", "sigkill,sigstop,cancel_burst", "--typed-weight", "30",
         "--workers", "2", "--concurrency", "2", "--strict-drain"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    print(proc.stdout[-6000:], proc.stderr[-4000:], sep="\n")
    summary = [line for line in proc.stdout.splitlines() if line.startswith("chaos: ")]
    assert summary, "the runner printed no summary line"
    assert proc.returncode == 0, summary[-1]
    assert " 0 not returning what was sent;" in summary[-1]
    assert "starved heads 0 (" in summary[-1]
    assert "typed calls 0," not in summary[-1], "the mix sent no typed call"
