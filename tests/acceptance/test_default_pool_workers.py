"""The implicit default pool with real prefork workers: unpooled tasks share its slots."""

from __future__ import annotations

import json

import pytest
from pytest_django import Settings

from pools.core import settings_sync
from pools.models import Pool, QueueEntry
from pools.states import EntryState
from tests.acceptance.conftest import WORKER_TEST_MARKS, StartWorkers, wait_for
from tests.acceptance.faults_support import max_overlap
from tests.testapp.tasks import free_span

pytestmark = WORKER_TEST_MARKS

DEFAULT = {"name": "default", "slots": 1, "queues": ["celery"]}
TASKS = 12
RESULT_TIMEOUT = 120


def test_default_pool__unpooled_tasks_on_its_queue_never_overlap_its_slots(
    celery_workers: StartWorkers, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POOLS_TEST_DEFAULT_POOL", json.dumps(DEFAULT))  # the workers' settings
    settings.POOLS = {**settings.POOLS, "DEFAULT_POOL": DEFAULT}  # this process's
    settings_sync.sync()
    celery_workers(count=2, concurrency=4)

    results = [free_span.delay(i, 0.1) for i in range(TASKS)]
    spans = [r.get(timeout=RESULT_TIMEOUT) for r in results]

    # Eight processes, one slot: the bodies ran one at a time (free_span alone overlaps,
    # see test_gate_workers' control), each under a claim of the default pool.
    assert max_overlap([(s["start"], s["end"]) for s in spans]) == 1
    assert all(s["entry_id"] is not None for s in spans)
    entries = QueueEntry.objects.filter(key__in=[r.id for r in results])
    # A result is stored before its attempt settles: wait for the last settles.
    wait_for(
        lambda: {e.state for e in entries.all()} == {EntryState.SUCCEEDED},
        RESULT_TIMEOUT,
        "every entry settled",
    )
    assert {json.dumps(e.demand) for e in entries} == {json.dumps({"default": 1})}
    assert Pool.objects.get(name="default").held == 0
