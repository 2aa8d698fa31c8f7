"""Fan-out on real workers: a group of pooled calls, enqueued as one batch, all run and
never more at once than the pool's slots (PostgreSQL + Redis, two prefork workers)."""

from __future__ import annotations

from typing import Any, cast
from unittest import mock

from celery import group
from celery.result import GroupResult

import pools
from pools.core import fanout
from pools.models import EntryState, Pool, QueueEntry
from tests.acceptance.conftest import WORKER_TEST_MARKS, StartWorkers, wait_for
from tests.acceptance.faults_support import max_overlap
from tests.testapp.tasks import ACCEPT_POOL, free_span, span

pytestmark = WORKER_TEST_MARKS

SLOTS = 3
CALLS = 60
RESULT_TIMEOUT = 120


def _spans(results: list[Any]) -> list[dict[str, Any]]:
    return [r.get(timeout=RESULT_TIMEOUT) for r in results]


def test_fanout__group_of_pooled_calls_runs_under_the_cap(celery_workers: StartWorkers) -> None:
    celery_workers(count=2, concurrency=4)
    # Control: the same body unpooled, as a group, does overlap more than the cap here.
    control = cast(GroupResult, group(free_span.s(i, 0.3) for i in range(16)).apply_async())
    control_spans = _spans(list(control.results or []))
    assert max_overlap([(s["start"], s["end"]) for s in control_spans]) > SLOTS

    Pool.objects.create(name=ACCEPT_POOL, slots=SLOTS)
    with mock.patch.object(fanout, "in_one_transaction", wraps=fanout.in_one_transaction) as spy:
        result = cast(GroupResult, group(span.s(i, 0.05) for i in range(CALLS)).apply_async())
    assert spy.call_count == 1, "the group's calls were enqueued as one batch"
    members = list(result.results or [])
    assert [r.id for r in members] == list(
        QueueEntry.objects.filter(task_name=span.name)
        .order_by("queue_id")
        .values_list("key", flat=True)
    )
    spans = _spans(members)
    assert sorted(s["i"] for s in spans) == list(range(CALLS))
    peak = max_overlap([(s["start"], s["end"]) for s in spans])
    assert peak <= SLOTS, f"{peak} bodies overlapped in a {SLOTS}-slot pool"
    assert peak >= 2, "bodies never overlapped: the workers did not run in parallel"
    assert [s["key"] for s in spans] == [r.id for r in members]

    def all_succeeded() -> bool:
        states = set(QueueEntry.objects.filter(task_name=span.name).values_list("state", flat=True))
        return states == {EntryState.SUCCEEDED}

    wait_for(all_succeeded, 30, "every entry of the group to settle")

    # enqueue_many: the same, its AsyncResults resolve with the bodies' results.
    results = pools.enqueue_many([span.s(100 + i, 0.02) for i in range(12)])
    spans = _spans(results)
    assert [s["i"] for s in spans] == [100 + i for i in range(12)]
    assert max_overlap([(s["start"], s["end"]) for s in spans]) <= SLOTS
