"""A warm shutdown (SIGTERM) gives a worker's slots back at once, not after the lease.

Celery's warm shutdown stops consuming and lets the bodies that are running finish; each
one settles as usual, so its slots are free when the worker exits. (A cold shutdown or a
SIGKILL falls back to the lease: see test_faults.py.)
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from pools.models import Demand, EntryState, Pool, QueueEntry
from tests.acceptance.conftest import WORKER_TEST_MARKS, StartWorkers
from tests.acceptance.faults_support import shared_dir, wait_for
from tests.testapp.fault_tasks import KILL_POOL, kill_span

pytestmark = WORKER_TEST_MARKS

__all__ = ["shared_dir"]  # fixture


def test_shutdown__warm_shutdown_settles_running_bodies_before_the_worker_exits(
    celery_workers: StartWorkers, shared_dir: Path
) -> None:
    pool = Pool.objects.create(name=KILL_POOL, slots=2)
    (worker,) = celery_workers(count=1, concurrency=2)
    results = [kill_span.delay(i, str(shared_dir), "nobody", 2.0) for i in range(2)]
    keys = [r.id for r in results]
    wait_for(
        lambda: QueueEntry.objects.filter(key__in=keys, state=EntryState.RUNNING).count() == 2,
        30,
        "both bodies to run",
    )
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
