"""A warm shutdown (SIGTERM) gives a worker's slots back at once, not after the lease.

Celery's warm shutdown stops consuming and lets the bodies that are running finish; each
one settles as usual, so its slots are free when the worker exits. (A cold shutdown or a
SIGKILL falls back to the lease: see test_faults.py.)
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from pools.models import Demand, Pool, PoolEvent, QueueEntry
from pools.states import EntryState, EventKind
from tests.acceptance.conftest import WORKER_TEST_MARKS, StartWorkers
from tests.acceptance.faults_support import read_notes, shared_dir, wait_for
from tests.testapp.fault_tasks import KILL_POOL, kill_span

pytestmark = WORKER_TEST_MARKS

__all__ = ["shared_dir"]  # fixture


def _started(where: Path) -> list[dict]:
    """The bodies that have started, from their own notes: a fenced start (PostgreSQL)
    leaves the entry ``admitted`` until the first lease renewal, after these bodies end."""
    return [n for n in read_notes(where, "spans") if n["event"] == "start"]


def test_shutdown__warm_shutdown_settles_running_bodies_before_the_worker_exits(
    celery_workers: StartWorkers, shared_dir: Path
) -> None:
    pool = Pool.objects.create(name=KILL_POOL, slots=2)
    (worker,) = celery_workers(count=1, concurrency=2)
    results = [kill_span.delay(i, str(shared_dir), "nobody", 2.0) for i in range(2)]
    keys = [r.id for r in results]
    wait_for(lambda: len(_started(shared_dir)) == 2, 30, "both bodies to run")
    leases = QueueEntry.objects.filter(key__in=keys).values_list("lease_expires_at", flat=True)
    lease_until = max(lease for lease in leases if lease is not None)

    worker.proc.send_signal(signal.SIGTERM)
    worker.proc.wait(timeout=30)
    exited = time.time()

    states = dict(QueueEntry.objects.filter(key__in=keys).values_list("key", "state"))
    assert states == {k: EntryState.SUCCEEDED for k in keys}, states
    assert Demand.objects.held_slots(pool.pk) == 0
    assert exited < lease_until.timestamp(), "the slots came back before the lease would lapse"
    assert sorted(r.get(timeout=10)["i"] for r in results) == [0, 1]


def test_shutdown__reserved_deliveries_are_requeued_not_left_holding_slots(
    celery_workers: StartWorkers, shared_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefetch 4, one process: two admitted deliveries wait inside the worker unstarted.

    At shutdown their entries go back in line at once (a new token), instead of holding
    their slots until another worker starts them or their lease lapses; the broker's
    returned copies are then stale and skipped, and each call runs exactly once.
    """
    monkeypatch.setenv("POOLS_TEST_PREFETCH", "4")
    Pool.objects.create(name=KILL_POOL, slots=3)
    (worker,) = celery_workers(count=1, concurrency=1)
    results = [kill_span.delay(i, str(shared_dir), "nobody", 3.0) for i in range(3)]
    keys = [r.id for r in results]
    wait_for(
        lambda: (
            len(_started(shared_dir)) == 1
            and "received" in worker.log_text()
            and worker.log_text().count("Task tests.testapp.fault_tasks.kill_span") >= 3
        ),
        30,
        "one body running and two deliveries reserved",
    )
    worker.proc.send_signal(signal.SIGTERM)
    worker.proc.wait(timeout=30)

    tokens = dict(QueueEntry.objects.filter(key__in=keys).values_list("key", "token"))
    assert sorted(tokens.values()) == [1, 2, 2], "the two reserved entries were requeued"
    requeued = PoolEvent.objects.filter(key__in=keys, kind=EventKind.REQUEUED)
    assert {e.detail.get("reason") for e in requeued} == {"worker shutdown"}

    celery_workers(count=1, concurrency=3)
    assert sorted(r.get(timeout=30)["i"] for r in results) == [0, 1, 2]
    spans = [n for n in read_notes(shared_dir, "spans") if n["event"] == "start"]
    assert sorted(n["i"] for n in spans) == [0, 1, 2], "every call ran exactly once"
