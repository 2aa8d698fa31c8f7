"""cancel(terminate=True) of a running pooled task, and worker liveness rows, on real workers."""

from __future__ import annotations

from pathlib import Path

import pools
from pools.models import QueueEntry, WorkerNode
from pools.states import HELD_STATES, EntryState
from tests.acceptance import faults_support
from tests.acceptance.conftest import WORKER_TEST_MARKS, StartWorkers
from tests.acceptance.faults_support import wait_for
from tests.acceptance.test_results import TIMEOUT, Holder, holder  # noqa: F401  (fixture)
from tests.testapp.fault_tasks import queued_member

pytestmark = WORKER_TEST_MARKS

shared_dir = faults_support.shared_dir


def test_cancel_terminate__stops_running_task_and_frees_its_slots(
    holder: Holder,  # noqa: F811  (the fixture imported above)
    shared_dir: Path,
) -> None:
    waiter = queued_member.delay(str(shared_dir), 7)
    assert QueueEntry.objects.get(key=waiter.id).state == EntryState.WAITING

    entry = pools.cancel(holder.result.id, terminate=True)
    # cancel() re-reads the entry after its commit has sent the revoke: a quick worker
    # (RabbitMQ's broadcast under load) may already have stopped it, as "revoked"; cancel
    # itself never ends running work (it would say "cancelled").
    # Held: running, or admitted (a fenced start, no renewal yet).
    assert entry.state in HELD_STATES or (entry.state, entry.reason) == (
        EntryState.CANCELLED,
        "revoked",
    ), f"running work is stopped by its worker, not here: {entry.state} {entry.reason!r}"

    # The worker kills the body, reports REVOKED and releases the slot; the waiter runs.
    assert waiter.get(timeout=TIMEOUT) == 7
    assert holder.result.state == "REVOKED"
    stopped = QueueEntry.objects.get(key=holder.result.id)
    assert (stopped.state, stopped.reason) == (EntryState.CANCELLED, "revoked")


def test_worker_nodes__each_worker_records_a_heartbeat(celery_workers: StartWorkers) -> None:
    workers = celery_workers(count=2, concurrency=1)
    names = {w.name for w in workers}
    wait_for(
        lambda: names <= set(WorkerNode.objects.values_list("hostname", flat=True)),
        TIMEOUT,
        "a WorkerNode row for each worker",
    )
    first = {n.hostname: n.last_seen for n in WorkerNode.objects.filter(hostname__in=names)}
    # The heartbeat keeps going (every HEARTBEAT_SECONDS; a third of the 30 s lease here).
    wait_for(
        lambda: all(
            WorkerNode.objects.get(hostname=h).last_seen > seen for h, seen in first.items()
        ),
        20,
        "a second heartbeat from each worker",
    )
