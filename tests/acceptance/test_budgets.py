"""Run budgets on real workers: each budget type stops a run when a grandchild spends it."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest

import pools
from pools import BudgetExceeded
from pools.models import QueueEntry, RunBudget
from pools.states import EntryState
from tests.acceptance.conftest import WORKER_TEST_MARKS, StartWorkers, wait_for
from tests.support.factories import make_pool
from tests.testapp.tasks import BUDGET_POOL, spend

pytestmark = WORKER_TEST_MARKS

TIMEOUT = 60
SIBLINGS = ("s1", "s2", "s3")


def tree(kind: str) -> dict[str, Any]:
    """root -> child (priority 5) -> grandchild (priority 10, spends the budget) -> late.

    The 1-slot pool runs one task at a time: the siblings the root starts (priority 0)
    are still waiting when the grandchild spends the budget.
    """
    spendings: dict[str, dict[str, Any]] = {
        "tokens": {"tokens": 1000},
        "cost": {"cost": 2.5},
        "seconds": {"sleep": 1.5},
    }
    spending = spendings[kind]
    grandchild = {"label": "grandchild", "priority": 10, **spending, "spawn": [{"label": "late"}]}
    child = {"label": "child", "priority": 5, "spawn": [grandchild]}
    return {"label": "root", "spawn": [child, *({"label": s} for s in SIBLINGS)]}


BUDGETS: dict[str, dict[str, Any]] = {
    "tokens": {"tokens": 1000},
    "cost": {"cost": 2, "tokens": 10**6},
    "seconds": {"seconds": 1.0},
}


@pytest.mark.parametrize(
    "kind,how", [("tokens", "limit_run"), ("cost", "pool_options"), ("seconds", "limit_run")]
)
def test_budget__a_grandchilds_spend_stops_the_run(
    celery_workers: StartWorkers, kind: str, how: str
) -> None:
    make_pool(BUDGET_POOL, 1)
    celery_workers(count=1, concurrency=2)
    if how == "limit_run":
        root = pools.limit_run(spend.s(**tree(kind)), budget=BUDGETS[kind])
    else:
        root = spend.apply_async(kwargs=tree(kind), pool_options={"budget": BUDGETS[kind]})  # type: ignore[call-arg]  # celery-types: no **options
    assert root.get(timeout=TIMEOUT)["label"] == "root"
    run_id = QueueEntry.objects.get(key=root.id).root_id or root.id
    run = wait_for(
        lambda: RunBudget.objects.filter(root_id=run_id).exclude(exhausted_by="").first(),
        TIMEOUT,
        f"the {kind} budget to stop run {run_id}",
    )
    assert run.exhausted_by == kind
    limit = BUDGETS[kind][kind]
    assert getattr(run, kind) >= limit

    def finished(label: str) -> QueueEntry | None:
        entry = QueueEntry.objects.filter(root_id=run_id, kwargs__label=label).first()
        return entry if entry is not None and entry.finished_at is not None else None

    # The siblings were waiting when the grandchild spent the budget: rejected, and each
    # AsyncResult fails with BudgetExceeded naming the budget and the amounts.
    for label in SIBLINGS:
        entry = wait_for(partial(finished, label), TIMEOUT, f"{label} to end")
        assert (entry.state, entry.reason) == (EntryState.REJECTED, "budget")
        result = spend.AsyncResult(entry.key)
        with pytest.raises(BudgetExceeded) as info:
            result.get(timeout=TIMEOUT)
        assert f"has spent its {kind} budget" in str(info.value)
        assert f"of {limit:g}" in str(info.value)
    # The tasks that spent ran to their end.
    for label in ("root", "child", "grandchild"):
        entry = wait_for(partial(finished, label), TIMEOUT, f"{label} to end")
        assert entry.state == EntryState.SUCCEEDED, (label, entry.state, entry.reason)
    grandchild = finished("grandchild")
    assert grandchild is not None
    late = spend.AsyncResult(grandchild.key).get(timeout=TIMEOUT)["children"][0]
    if kind == "seconds":
        # Task seconds are charged when the grandchild settles, after it sent "late": that
        # entry was waiting, and was rejected with the siblings.
        entry = wait_for(lambda: finished("late"), TIMEOUT, "late to end")
        assert (entry.state, entry.reason) == (EntryState.REJECTED, "budget")
    else:
        # Its charge stopped the run inside its body: its own submit was refused.
        assert late.startswith(f"refused: Run {run_id!r} has spent its {kind} budget")
        assert not QueueEntry.objects.filter(root_id=run_id, kwargs__label="late").exists()
    # Nothing of the run waits or holds a slot.
    assert not QueueEntry.objects.filter(root_id=run_id, finished_at__isnull=True).exists()
    spent = pools.run_spend(run_id)
    assert spent is not None and spent.stopped_by == kind
    assert spent.spent["seconds"] > 0, "the workers measured task seconds"
