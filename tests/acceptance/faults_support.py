"""Helpers and fixtures for the fault and result acceptance tests.

* ``short_leases``: LEASE_SECONDS=3 (heartbeat 1 s), SWEEP_SECONDS=1 in this process
  (``settings``) and in every worker or beat started afterwards (environment, read by
  ``tests/settings.py`` at import).
* ``celery_beat``: a real ``celery beat`` subprocess with the django-celery-beat
  ``DatabaseScheduler``, firing the ``pools: sweep`` periodic task every SWEEP_SECONDS.
* The body recorder: pooled bodies append JSON lines to files in a shared directory
  (:func:`tests.testapp.fault_tasks.note`); :func:`read_notes` and :func:`intervals`
  turn them into the intervals during which a body held a slot.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pytest_django import Settings

from pools.celery import processes
from pools.celery.processes import Process
from tests.acceptance.conftest import StartWorkers, start_celery, wait_for

#: Lease used by the fault tests; the heartbeat is a third of it (1 s).
LEASE_SECONDS = 3.0
#: Sweep interval used by the fault tests (the beat fires ``pools: sweep`` this often).
SWEEP_SECONDS = 1.0
#: How long beat may take to send its first sweep.
BEAT_START_TIMEOUT = 30.0
#: How long beat may take to stop on SIGTERM before its process group is killed.
BEAT_STOP_TIMEOUT = 10.0

__all__ = [
    "LEASE_SECONDS",
    "SWEEP_SECONDS",
    "Beat",
    "celery_beat",
    "intervals",
    "max_overlap",
    "read_notes",
    "shared_dir",
    "short_leases",
    "wait_for",
    "wait_notes",
]


@pytest.fixture
def short_leases(monkeypatch: pytest.MonkeyPatch, settings: Settings) -> None:
    """LEASE_SECONDS=3 (heartbeat 1 s) and SWEEP_SECONDS=1 here and in workers started later."""
    monkeypatch.setenv("POOLS_LEASE_SECONDS", str(LEASE_SECONDS))
    monkeypatch.setenv("POOLS_SWEEP_SECONDS", str(SWEEP_SECONDS))
    monkeypatch.delenv("POOLS_HEARTBEAT_SECONDS", raising=False)
    pools = {k: v for k, v in settings.POOLS.items() if k != "HEARTBEAT_SECONDS"}
    settings.POOLS = {**pools, "LEASE_SECONDS": LEASE_SECONDS, "SWEEP_SECONDS": SWEEP_SECONDS}


@pytest.fixture
def shared_dir(tmp_path: Path) -> Path:
    """A directory the test and the worker processes both write to (the body recorder)."""
    where = tmp_path / "shared"
    where.mkdir()
    return where


@dataclass
class Beat:
    """One ``celery beat`` subprocess."""

    process: Process

    def log_text(self) -> str:
        return self.process.log_text()

    def sweeps_sent(self) -> int:
        """How many ``pools: sweep`` messages beat has sent so far."""
        return self.log_text().count("Sending due task pools: sweep")


@pytest.fixture
def celery_beat(
    request: pytest.FixtureRequest, tmp_path: Path, celery_workers: StartWorkers
) -> Iterator[Callable[[], Beat]]:
    """Factory: start a real beat (DatabaseScheduler) once the sweep schedule is checked.

    Start workers first: the first worker start flushes the broker.
    """
    started: list[Beat] = []

    def start() -> Beat:
        from django_celery_beat.models import IntervalSchedule, PeriodicTask

        from pools import conf
        from pools.celery import beat

        # The row was written by migrate/flush with the settings of that moment; write it
        # again with this test's SWEEP_SECONDS (what migrate does), then check it.
        assert beat.ensure_sweep_schedule()
        task = PeriodicTask.objects.select_related("interval").get(name=beat.SWEEP_TASK_NAME)
        assert task.enabled and task.task == "pools.sweep"
        assert task.interval is not None
        assert (task.interval.every, task.interval.period) == (
            round(conf.get().SWEEP_SECONDS),
            IntervalSchedule.SECONDS,
        )
        log = tmp_path / f"beat-{len(started) + 1}.log"
        process = start_celery(
            request,
            [
                "beat",
                "-S",
                "django_celery_beat.schedulers:DatabaseScheduler",
                "--max-interval",
                "1",
                "-l",
                "info",
            ],
            cwd=tmp_path,  # nothing beat writes lands in the repository
            log=log,
            name=f"beat-{len(started) + 1}",
        )
        handle = Beat(process)
        started.append(handle)

        def first_sweep_sent() -> bool:
            if not process.alive():
                pytest.fail(f"beat exited with {process.returncode}:\n{handle.log_text()[-5000:]}")
            return handle.sweeps_sent() > 0

        wait_for(first_sweep_sent, BEAT_START_TIMEOUT, "beat to send its first sweep", 0.2)
        return handle

    yield start

    processes.stop([b.process for b in started], BEAT_STOP_TIMEOUT)


# --------------------------------------------------------------------------- recorder


def read_notes(where: Path, name: str) -> list[dict[str, Any]]:
    """The JSON lines bodies appended to ``<where>/<name>.jsonl`` (empty if none yet)."""
    path = where / f"{name}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def intervals(
    notes: list[dict[str, Any]], *, killed_at: float | None = None
) -> list[tuple[float, float, dict[str, Any]]]:
    """``(start, end, start note)`` per body attempt, from ``start``/``end`` notes.

    An attempt is identified by (key, token, pid). One with a start and no end was killed:
    its end is ``killed_at`` (it must be given then).
    """
    starts: dict[tuple[Any, ...], dict[str, Any]] = {}
    ends: dict[tuple[Any, ...], float] = {}
    for n in notes:
        ident = (n["key"], n["token"], n["pid"])
        if n["event"] == "start":
            assert ident not in starts, f"attempt {ident} started twice"
            starts[ident] = n
        elif n["event"] == "end":
            ends[ident] = n["t"]
    assert set(ends) <= set(starts), "an end without a start"
    spans = []
    for ident, n in starts.items():
        end = ends.get(ident)
        if end is None:
            assert killed_at is not None, f"attempt {ident} never ended and nothing was killed"
            end = killed_at
        spans.append((n["t"], end, n))
    return sorted(spans, key=lambda s: s[0])


def max_overlap(spans: list[tuple[float, float]]) -> int:
    """Largest number of ``[start, end)`` intervals covering one instant."""
    # At equal times an end (-1) sorts before a start (+1): touching intervals do not overlap.
    edges = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    return peak


def wait_notes(
    where: Path,
    name: str,
    predicate: Callable[[list[dict[str, Any]]], bool],
    timeout: float,
    what: str,
) -> list[dict[str, Any]]:
    """Wait until ``predicate(read_notes(where, name))`` holds; return the notes."""

    def check() -> list[dict[str, Any]] | None:
        notes = read_notes(where, name)
        return notes if predicate(notes) else None

    found: list[dict[str, Any]] = wait_for(check, timeout, what, 0.05)
    return found
