"""Node affinity on real workers: a pinned entry runs on its worker only, and waits
(blocking its pool) while that worker is stopped, until it is back."""

from __future__ import annotations

from pathlib import Path

import pytest

from pools.celery import processes
from pools.core import explain
from pools.models import QueueEntry, WorkerNode
from pools.states import EntryState
from tests.acceptance.conftest import (
    ROOT,
    START_TIMEOUT,
    STOP_TIMEOUT,
    WORKER_TEST_MARKS,
    StartWorkers,
    _worker_env,
)
from tests.acceptance.faults_support import wait_for
from tests.support.factories import make_pool
from tests.testapp.tasks import record

pytestmark = WORKER_TEST_MARKS

TIMEOUT = 30


def test_node_affinity__pinned_entry_waits_for_its_stopped_worker_and_runs_there(
    celery_workers: StartWorkers, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    from tests.celery_app import app

    make_pool("warehouse", 2)
    pinned_to, other = celery_workers(count=2, concurrency=1)
    hosts = {pinned_to.name, other.name}
    wait_for(
        lambda: hosts <= set(WorkerNode.objects.values_list("hostname", flat=True)),
        TIMEOUT,
        "a heartbeat from each worker",
    )
    processes.stop([pinned_to], STOP_TIMEOUT)  # a clean shutdown forgets its heartbeat row
    assert not WorkerNode.objects.filter(hostname=pinned_to.name).exists()

    pinned = record.apply_async((1,), pool_options={"worker": pinned_to.name})  # type: ignore[call-arg]
    behind = record.delay(2)
    # The other worker is alive and the pool has 2 free slots: both still wait.
    assert QueueEntry.objects.get(key=pinned.id).state == EntryState.WAITING
    assert explain.explain_key(pinned.id).blocked_by == "worker_unavailable"
    assert QueueEntry.objects.get(key=behind.id).state == EntryState.WAITING
    assert explain.explain_key(behind.id).blocked_by == "head_of_line"

    # The same worker (same node name) comes back: its first heartbeat admits the entry.
    back = processes.start_worker(
        "tests",
        node=pinned_to.name.split("@")[0],
        log=tmp_path / "back.log",
        concurrency=1,
        env=_worker_env(),
        cwd=ROOT,
    )
    try:
        processes.wait_ready([back], timeout=START_TIMEOUT, ping=app)
        assert pinned.get(timeout=TIMEOUT)["i"] == 1
        assert behind.get(timeout=TIMEOUT)["i"] == 2
    finally:
        processes.stop([back], STOP_TIMEOUT)
    ran = QueueEntry.objects.get(key=pinned.id)
    assert (ran.state, ran.worker) == (EntryState.SUCCEEDED, pinned_to.name)
