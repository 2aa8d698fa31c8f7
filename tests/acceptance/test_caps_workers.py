"""Workflow caps with real workers: a task cap and a run cap over a 500-member group
(with tasks started by tasks), on 2 prefork workers x 4 processes."""

from __future__ import annotations

from typing import Any

import pytest
from celery import group

import pools
from pools.models import Pool, QueueEntry
from pools.states import EntryState
from tests.acceptance.conftest import WORKER_TEST_MARKS, StartWorkers
from tests.acceptance.faults_support import max_overlap, wait_for
from tests.testapp import tasks

capped_span: Any = tasks.capped_span
run_member: Any = tasks.run_member
free_span: Any = tasks.free_span

pytestmark = WORKER_TEST_MARKS

RESULT_TIMEOUT = 120


def spans_of(results: list[Any]) -> list[dict[str, Any]]:
    return [r.get(timeout=RESULT_TIMEOUT) for r in results]


def test_task_cap__never_more_than_max_running_bodies_at_once(
    celery_workers: StartWorkers,
) -> None:
    celery_workers(count=2, concurrency=4)
    # Control: the same body unpooled overlaps beyond the cap on these workers.
    control = spans_of([free_span.delay(i, 0.3) for i in range(12)])
    assert max_overlap([(s["start"], s["end"]) for s in control]) > 3
    spans = spans_of([capped_span.delay(i, 0.1) for i in range(30)])
    peak = max_overlap([(s["start"], s["end"]) for s in spans])
    assert 2 <= peak <= 3, f"{peak} bodies of a max_running=3 task overlapped"
    assert all(s["token"] for s in spans)


@pytest.mark.timeout(300)
def test_run_cap__a_500_member_group_never_has_more_than_4_admitted(
    celery_workers: StartWorkers,
) -> None:
    """Every 50th member starts a child task: the children share the run's root id and
    count against the same cap."""
    celery_workers(count=2, concurrency=4)
    Pool.objects.create(name=tasks.BULK_POOL, slots=50)
    members = group(run_member.s(i, 0.01, spawn=(i % 50 == 0)) for i in range(500))
    result = pools.limit_run(members, max_running=4)
    spans = result.get(timeout=RESULT_TIMEOUT * 2)
    children = [s["child"] for s in spans if s["child"]]
    assert len(children) == 10
    spans += [run_member.AsyncResult(c).get(timeout=RESULT_TIMEOUT) for c in children]
    assert len(spans) == 510
    peak = max_overlap([(s["start"], s["end"]) for s in spans])
    assert 2 <= peak <= 4, f"{peak} bodies of a run capped at 4 overlapped"
    root = QueueEntry.objects.get(key=children[0]).root_id
    cap = Pool.objects.get(name=f"run-cap:{root}")
    assert cap.slots == 4 and cap.admissions == 510

    def all_settled() -> bool:
        return not QueueEntry.objects.exclude(state=EntryState.SUCCEEDED).exists()

    wait_for(all_settled, 30, "every entry settled")
