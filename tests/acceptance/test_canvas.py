"""Canvas members of pooled tasks go through the gate and complete on real workers."""

from __future__ import annotations

from typing import Any

import pytest
from celery import chain, chord, group
from celery.result import AsyncResult, GroupResult, ResultBase

from pools.models import QueueEntry
from pools.states import EntryState
from tests.acceptance.conftest import WORKER_TEST_MARKS, StartWorkers, Worker, wait_for
from tests.testapp.tasks import add, tsum

pytestmark = WORKER_TEST_MARKS

TIMEOUT = 60


def settled(*keys: str) -> dict[str, str]:
    """Wait until every key has a finished entry; return ``{key: state}``."""

    def states() -> dict[str, str] | None:
        found = dict(QueueEntry.objects.filter(key__in=keys).values_list("key", "state"))
        if len(found) == len(keys) and all(
            s not in (EntryState.WAITING, EntryState.ADMITTED, EntryState.RUNNING)
            for s in found.values()
        ):
            return found
        return None

    result: dict[str, str] = wait_for(states, 30, f"entries {keys} to settle")
    return result


def parent_of(result: ResultBase) -> AsyncResult[Any]:
    """The result of the previous link of a chain."""
    parent = result.parent
    assert isinstance(parent, AsyncResult), f"{result!r} has no parent result"
    return parent


@pytest.fixture
def workers(celery_workers: StartWorkers) -> list[Worker]:
    return celery_workers(count=2, concurrency=2)


def test_canvas__chain_of_pooled_tasks_passes_results_along(workers: list[Worker]) -> None:
    result = chain(add.s(1, 2), add.s(10), add.s(100)).apply_async()
    assert result.get(timeout=TIMEOUT) == 113
    middle = parent_of(result)
    first = parent_of(middle)
    keys = [first.id, middle.id, result.id]
    assert [r.get(timeout=TIMEOUT) for r in (first, middle)] == [3, 13]
    # Every link was an entry of the pool (gated), and each settled as succeeded.
    assert set(settled(*keys).values()) == {EntryState.SUCCEEDED}
    links = QueueEntry.objects.filter(key__in=keys)
    assert {e.demand["warehouse"] for e in links} == {1}
    root = first.id
    assert {e.root_id or e.key for e in links} == {root}


def test_canvas__chord_of_pooled_header_and_pooled_body(workers: list[Worker]) -> None:
    header = [add.s(i, i) for i in range(6)]
    result = chord(header)(tsum.s())
    assert result.get(timeout=TIMEOUT) == sum(2 * i for i in range(6))
    body = QueueEntry.objects.get(key=result.id)
    assert body.demand == {"partner-api": 1}
    group_result = result.parent
    assert isinstance(group_result, GroupResult)  # the header's results
    header_results = group_result.results
    assert header_results is not None
    assert [r.get(timeout=TIMEOUT) for r in header_results] == [2 * i for i in range(6)]
    states = settled(*[r.id for r in header_results], result.id)
    assert set(states.values()) == {EntryState.SUCCEEDED}
    assert QueueEntry.objects.filter(task_name=add.name).count() == len(header)


def test_canvas__group_of_pooled_tasks_returns_every_result(workers: list[Worker]) -> None:
    result = group(add.s(i, 1) for i in range(8)).apply_async()
    assert isinstance(result, GroupResult)
    assert result.get(timeout=TIMEOUT) == [i + 1 for i in range(8)]
    states = settled(*[r.id for r in result.results])
    assert set(states.values()) == {EntryState.SUCCEEDED}


def test_canvas__chain_into_chord_across_two_pools(workers: list[Worker]) -> None:
    workflow = chain(add.s(2, 3), group(add.s(1), add.s(2), add.s(3)), tsum.s())
    result = workflow.apply_async()
    assert result.get(timeout=TIMEOUT) == (5 + 1) + (5 + 2) + (5 + 3)
    assert set(settled(result.id).values()) == {EntryState.SUCCEEDED}
    assert QueueEntry.objects.filter(task_name=add.name).count() == 4
