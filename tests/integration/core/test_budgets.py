"""Run budgets on the core (no Celery): charges, stopping a run, refusing its submits."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from pools.core import admission, budgets
from pools.core.records import BUDGET_OPTION, Enqueued, Submission
from pools.exceptions import BudgetExceeded, LeaseLost, PoolConfigurationError
from pools.models import Charge, PoolEvent, QueueEntry, RunBudget
from pools.specs import Budget, PoolSpec
from pools.states import EntryState, EventKind
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool

pytestmark = pytest.mark.django_db(transaction=True)


def send(
    key: str,
    *,
    root: str = "",
    parent: str = "",
    pool: str = "p",
    budget: dict[str, Any] | None = None,
    attempt: int = 0,
) -> Enqueued:
    """Submit task ``key`` of run ``root`` (its own id when empty: the first task)."""
    spec = PoolSpec.build(pool)
    if budget is not None:
        spec = replace(spec, budget=Budget.from_mapping(budget))
    return admission.enqueue(
        Submission(
            key=key,
            task_name="tests.fake",
            spec=spec,
            root_id=root or key,
            parent_id=parent,
            attempt=attempt,
        )
    )


def entry(key: str) -> QueueEntry:
    return QueueEntry.objects.filter(key=key).latest("queue_id")


def held(key: str) -> tuple[int, int]:
    e = entry(key)
    assert e.state in (EntryState.ADMITTED, EntryState.RUNNING), e.state
    return e.queue_id, e.token


def test_cost_budget__the_charge_that_spends_it_rejects_the_waiting_and_refuses_new(
    recorder: RecordingBridge,
) -> None:
    make_pool("p", 1)
    send("root", budget={"cost": 10})
    assert RunBudget.objects.get(root_id="root").max_cost == 10
    send("c1", root="root", parent="root")
    send("c2", root="root", parent="root")
    send("other")  # another run, behind them in the same pool
    assert [entry(k).state for k in ("c1", "c2")] == [EntryState.WAITING] * 2
    assert BUDGET_OPTION in entry("c1").options, "entries of a budgeted run are marked"

    first = budgets.charge(*held("root"), cost=4)
    assert first is not None and (first.cost, first.stopped_by, first.rejected) == (4, "", 0)
    crossing = budgets.charge(*held("root"), cost=6.5)
    assert crossing is not None
    assert (crossing.cost, crossing.stopped_by, crossing.rejected) == (10.5, "cost", 2)

    for key in ("c1", "c2"):
        e = entry(key)
        assert (e.state, e.reason) == (EntryState.REJECTED, "budget")
    stops = {f.key: f.budget for f in recorder.finished}
    assert set(stops) == {"c1", "c2"}
    stop = stops["c1"]
    assert stop is not None and (stop.run, stop.budget, stop.limit, stop.spent) == (
        "root",
        "cost",
        10.0,
        10.5,
    )
    assert PoolEvent.objects.filter(kind=EventKind.REJECTED, key="c1").exists()
    # The other run's entry keeps its place; the root still holds the slot.
    assert entry("other").state == EntryState.WAITING
    run = RunBudget.objects.get(root_id="root")
    assert (run.exhausted_by, run.cost) == ("cost", 10.5) and run.exhausted_at is not None

    with pytest.raises(BudgetExceeded) as refused:
        send("c3", root="root", parent="root")
    exc = refused.value
    assert (exc.run, exc.budget, exc.limit, exc.spent, exc.code) == (
        "root",
        "cost",
        10.0,
        10.5,
        "budget_exceeded",
    )
    assert "spent its cost budget: 10.5 of 10" in str(exc)
    assert not QueueEntry.objects.filter(key="c3").exists(), "a refused submit writes nothing"
    # A retry of the root itself (same id, next attempt) is refused too.
    with pytest.raises(BudgetExceeded):
        send("root", attempt=1)
    # When the root settles, the other run is admitted: nothing of the stopped run waits.
    admission.settle(*held("root"), EntryState.SUCCEEDED)
    assert entry("other").state == EntryState.ADMITTED


def test_tokens_budget__a_grandchilds_charge_stops_the_run(recorder: RecordingBridge) -> None:
    make_pool("p", 3)
    make_pool("q", 1)
    send("root", budget={"tokens": 1000, "cost": 100})
    send("child", root="root", parent="root")
    send("grandchild", root="root", parent="child")
    send("blocker", pool="q")  # another run holds q
    send("cousin", root="root", parent="child", pool="q")  # waits in q
    send("cousin2", root="root", parent="root", pool="q")
    assert budgets.charge(*held("grandchild"), tokens=600) is not None
    assert entry("cousin").state == EntryState.WAITING
    charged = budgets.charge(*held("grandchild"), tokens=400)
    assert charged is not None and (charged.tokens, charged.stopped_by) == (1000, "tokens")
    assert {f.key for f in recorder.finished} == {"cousin", "cousin2"}
    # Held entries of the run are not stopped: they finish and their spend still counts.
    assert entry("child").state == EntryState.ADMITTED
    late = budgets.charge(*held("child"), cost=1)
    assert late is not None and (late.cost, late.stopped_by) == (1, "")
    assert RunBudget.objects.get(root_id="root").exhausted_by == "tokens"
    with pytest.raises(BudgetExceeded, match="tokens budget: 1000 of 1000 tokens"):
        send("great-grandchild", root="root", parent="grandchild")


def test_seconds_budget__measured_at_settle_counts_once_per_attempt(
    recorder: RecordingBridge,
) -> None:
    make_pool("p", 1)
    send("root", budget={"seconds": 5})
    send("c1", root="root", parent="root")
    root = held("root")
    budgets.charge(*root, seconds=3)
    again = budgets.charge(*root, seconds=3)  # reported twice (a retried settle): once
    assert again is not None and (again.seconds, again.stopped_by) == (3, "")
    assert Charge.objects.get(entry_id=root[0], token=root[1]).seconds == 3
    admission.settle(*root, EntryState.SUCCEEDED)
    c1 = held("c1")
    stopped = budgets.charge(*c1, seconds=2.5)
    assert stopped is not None and (stopped.seconds, stopped.stopped_by) == (5.5, "seconds")
    with pytest.raises(BudgetExceeded, match=r"seconds budget: 5\.5 of 5 task seconds"):
        send("c2", root="root", parent="c1")


def test_charge__stale_token_is_refused_and_counts_nothing(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    send("root", budget={"cost": 10})
    first = held("root")
    budgets.charge(*first, cost=2)
    # The lease is lost: the entry goes back in line and is admitted again (new token).
    assert admission.requeue(*first, reason="lease lost")
    second = held("root")
    assert second[1] == first[1] + 1
    with pytest.raises(LeaseLost):
        budgets.charge(*first, cost=5)  # the old body, still running somewhere
    budgets.charge(*second, cost=3)
    run = RunBudget.objects.get(root_id="root")
    assert run.cost == 5
    rows = sorted(Charge.objects.values_list("token", "cost"))
    assert rows == [(first[1], 2.0), (second[1], 3.0)], "one row per attempt"


def test_requeue_of_a_stopped_runs_entry__is_rejected_not_put_back(
    recorder: RecordingBridge,
) -> None:
    make_pool("p", 2)
    send("root", budget={"cost": 1})
    send("child", root="root", parent="root")
    child = held("child")
    budgets.charge(*held("root"), cost=1)
    assert entry("child").state == EntryState.ADMITTED, "held entries are not stopped"
    assert admission.requeue(*child, reason="lease lost")
    e = entry("child")
    assert (e.state, e.reason) == (EntryState.REJECTED, "budget")
    assert [f.key for f in recorder.finished if f.budget] == ["child"]


def test_run_without_budget__charges_nothing_and_first_tasks_look_nothing_up(
    recorder: RecordingBridge,
) -> None:
    make_pool("p", 2)
    send("root")
    assert budgets.charge(*held("root"), cost=5) is None
    assert not Charge.objects.exists() and not RunBudget.objects.exists()
    send("child", root="root", parent="root")
    assert BUDGET_OPTION not in entry("child").options
    assert budgets.may_have_budget(
        Submission(key="c", task_name="t", spec=PoolSpec.build("p"), root_id="root")
    )
    assert not budgets.may_have_budget(
        Submission(key="root2", task_name="t", spec=PoolSpec.build("p"), root_id="root2")
    ), "a first task without a budget looks nothing up"


def test_budget_on_a_task_inside_a_run__is_refused(recorder: RecordingBridge) -> None:
    make_pool("p", 2)
    send("root")
    with pytest.raises(PoolConfigurationError, match="first task of a run"):
        send("child", root="root", parent="root", budget={"cost": 1})
    assert not QueueEntry.objects.filter(key="child").exists()


def test_open_run__then_tasks_of_the_run_are_budgeted(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    budgets.open_run("run-1", {"tokens": 10})
    with pytest.raises(PoolConfigurationError, match="already has a budget"):
        budgets.open_run("run-1", {"tokens": 10})
    send("a", root="run-1")
    send("b", root="run-1")
    budgets.charge(*held("a"), tokens=10)
    assert entry("b").state == EntryState.REJECTED
    spend = budgets.spend("run-1")
    assert spend is not None
    assert (spend.limits, spend.spent["tokens"], spend.stopped_by, spend.attempts) == (
        {"tokens": 10.0},
        10.0,
        "tokens",
        1,
    )
    assert budgets.spend("nope") is None


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"cost": -1}, "non-negative number"),
        ({"tokens": 1.5}, "non-negative integer"),
        ({"cost": True}, "non-negative number"),
    ],
)
def test_charge__bad_amounts_are_refused(
    recorder: RecordingBridge, kwargs: dict[str, Any], match: str
) -> None:
    make_pool("p", 1)
    send("root", budget={"cost": 10})
    with pytest.raises(PoolConfigurationError, match=match):
        budgets.charge(*held("root"), **kwargs)
    assert RunBudget.objects.get(root_id="root").cost == 0


def test_prune__drops_old_budgets_of_finished_runs_only(recorder: RecordingBridge) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from pools.core import sweeps

    make_pool("p", 1)
    send("done", budget={"cost": 5})  # admitted, then finished
    budgets.charge(*held("done"), cost=1)
    admission.settle(*held("done"), "succeeded")
    send("busy", budget={"cost": 5})  # admitted: it holds the one slot
    send("busy-child", root="busy", parent="busy")  # waits: the run is unfinished
    old = timezone.now() - timedelta(days=30)
    RunBudget.objects.update(created_at=old)
    sweeps.prune(timezone.now())
    assert set(RunBudget.objects.values_list("root_id", flat=True)) == {"busy"}
    assert not Charge.objects.filter(run__root_id="done").exists()
    # A young budget stays, finished or not.
    send("fresh", budget={"cost": 5})
    admission.cancel("fresh")
    sweeps.prune(timezone.now())
    assert set(RunBudget.objects.values_list("root_id", flat=True)) == {"busy", "fresh"}
