"""Run budgets: what a run (every entry sharing a ``root_id``) may spend, and its charges.

A run gets a budget when its first task is submitted with ``pool_options={"budget": ...}``
or through ``pools.limit_run(signature, budget=...)``: a :class:`~pools.models.RunBudget`
row. Task bodies report cost and tokens with ``pools.charge()``; workers report each
attempt's task seconds when they settle it. Every charge is a row per (entry, fencing
token): an attempt is charged once, however often it reports, and a body whose lease was
lost (its token is stale) charges nothing more.

Locks, in this order: the run's budget row (``SELECT ... FOR UPDATE``), then pool rows
(:func:`pools.core.locking.locked_pools`, in name order). Every enqueue of a run with a
budget takes the run's row first and refuses with :class:`BudgetExceeded` once the run is
stopped; the charge that spends a budget marks the run stopped and ends the run's waiting
entries ``rejected`` (reason ``budget``) in the same transaction, holding the locks of
every pool of the run's unfinished entries. So from the moment that transaction commits,
the run has no waiting entry and can get none: admission itself (both paths) needs no
budget check. Entries already admitted or running when a budget is spent run to their
end (their spend is counted, so a run can overshoot by what it had in flight).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime

from django.db.models import Q
from django.utils import timezone

from pools.core import locking
from pools.core.ending import finish_waiting
from pools.core.pass_runs import admit_in, follow_up
from pools.core.records import BUDGET, BUDGET_OPTION, BudgetStop, Finished, Submission
from pools.exceptions import BudgetExceeded, EntryNotFound, LeaseLost, PoolConfigurationError
from pools.models import Charge, QueueEntry, RunBudget
from pools.specs import BUDGET_KINDS, Budget
from pools.states import EntryState


def run_id_of(sub: Submission) -> str:
    """The run a submission belongs to: its ``root_id`` (Celery sets it to the task's own
    id on the first task of a workflow)."""
    return sub.root_id or sub.key


def may_have_budget(sub: Submission) -> bool:
    """Whether enqueueing ``sub`` must look for its run's budget (no query).

    A first call (``root_id`` is its own id, first attempt) without a budget cannot belong
    to a run with one: ``limit_run`` gives the run an id of its own.
    """
    return sub.spec.budget is not None or run_id_of(sub) != sub.key or sub.attempt > 0


def has_budget(run_id: str) -> bool:
    """Whether run ``run_id`` has a budget (one indexed query)."""
    with locking.unavailable_on_error("reading a run budget"):
        return RunBudget.objects.filter(root_id=run_id).exists()


def open_run(
    run_id: str, budget: Budget | dict[str, object], *, now: datetime | None = None
) -> RunBudget:
    """Give run ``run_id`` a budget (before its first task is sent); returns the row.

    Raises :class:`PoolConfigurationError` for a bad budget or a run that already has one.
    """
    limits = Budget.from_mapping(budget)
    with locking.bounded("opening a run budget"):
        if RunBudget.objects.filter(root_id=run_id).exists():
            raise PoolConfigurationError(
                f"Run {run_id!r} already has a budget; a run's budget is set once, on its "
                f"first task."
            )
        return RunBudget.objects.create(
            root_id=run_id,
            max_seconds=limits.seconds,
            max_cost=limits.cost,
            max_tokens=limits.tokens,
            created_at=now or timezone.now(),
        )


def lock_for_enqueue(sub: Submission, now: datetime) -> RunBudget | None:
    """Inside the enqueue's transaction, before its pool locks: the run's budget row, locked.

    Creates it when ``sub`` carries a budget (the first task of the run). Raises
    :class:`BudgetExceeded` when the run has spent a budget. ``None``: the run has none.
    """
    run_id = run_id_of(sub)
    run = RunBudget.objects.select_for_update().filter(root_id=run_id).first()
    if sub.spec.budget is not None:
        if run_id != sub.key and sub.attempt == 0 and run is None:
            raise PoolConfigurationError(
                f"pool_options['budget'] given on {sub.task_name}[{sub.key}], a task of run "
                f"{run_id!r}: a budget is given on the first task of a run (or with "
                f"pools.limit_run()), and covers every task the run starts."
            )
        if run is None:
            limits = sub.spec.budget
            run = RunBudget.objects.create(
                root_id=run_id,
                max_seconds=limits.seconds,
                max_cost=limits.cost,
                max_tokens=limits.tokens,
                created_at=now,
            )
    if run is not None and run.exhausted_by:
        raise exceeded(run)
    return run


def stop_of(run: RunBudget) -> BudgetStop:
    """The budget that stopped ``run`` and its amounts."""
    kind = run.exhausted_by
    return BudgetStop(
        run=run.root_id,
        budget=kind,
        limit=float(getattr(run, f"max_{kind}")),
        spent=float(getattr(run, kind)),
    )


def exceeded(run: RunBudget) -> BudgetExceeded:
    """The refusal for a submit to a stopped run."""
    stop = stop_of(run)
    return BudgetExceeded(stop.run, stop.budget, stop.limit, stop.spent)


def _crossed(run: RunBudget) -> str:
    """The first budget (in :data:`BUDGET_KINDS` order) the run has spent, or ``""``."""
    for kind in BUDGET_KINDS:
        limit = getattr(run, f"max_{kind}")
        if limit is not None and getattr(run, kind) >= limit:
            return kind
    return ""


@dataclass(frozen=True, kw_only=True)
class Charged:
    """Outcome of :func:`charge`: the run's spend after it, and whether it stopped the run."""

    run: str
    seconds: float
    cost: float
    tokens: int
    #: The budget this charge spent (it stopped the run), or ``""``.
    stopped_by: str = ""
    #: Waiting entries of the run this charge ended (``rejected``, reason ``budget``).
    rejected: int = 0


def _check_amount(value: object, what: str, *, integer: bool = False) -> None:
    kinds = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value < 0:
        kind = "a non-negative integer" if integer else "a non-negative number"
        raise PoolConfigurationError(f"pools.charge({what}=...) must be {kind}, got {value!r}.")


def charge(
    entry_id: int,
    token: int,
    *,
    cost: float = 0,
    tokens: int = 0,
    seconds: float | None = None,
    now: datetime | None = None,
) -> Charged | None:
    """Charge one attempt (entry ``entry_id`` under fencing token ``token``) to its run.

    ``cost`` and ``tokens`` add to the attempt's charge row; ``seconds`` (the worker, at
    settle) sets its task time, so reporting it twice counts once. Returns ``None``, writing
    nothing, when the run has no budget. Raises :class:`LeaseLost` when ``token`` is no longer
    the entry's (the attempt lost its lease and the entry was admitted again: the new attempt
    charges for itself), :class:`EntryNotFound` for an unknown entry.

    The charge that spends a budget stops the run, in the same transaction: see the module
    docstring.
    """
    _check_amount(cost, "cost")
    _check_amount(tokens, "tokens", integer=True)
    if seconds is not None:
        _check_amount(seconds, "seconds")
    now = now or timezone.now()
    needs: set[str] = set()
    with locking.bounded(f"charging entry {entry_id}"):
        entry = (
            QueueEntry.objects.filter(pk=entry_id)
            .values("root_id", "key", "token", "task_name")
            .first()
        )
        if entry is None:
            raise EntryNotFound(str(entry_id))
        run_id = entry["root_id"] or entry["key"]
        run = RunBudget.objects.select_for_update().filter(root_id=run_id).first()
        if run is None:
            return None
        if entry["token"] != token:
            raise LeaseLost(
                f"Entry {entry_id} is no longer held under token {token} (its lease was lost "
                f"and it was admitted again); this attempt's charge is not counted."
            )
        row, _ = Charge.objects.get_or_create(
            entry_id=entry_id,
            token=token,
            defaults={"run": run, "key": entry["key"], "task_name": entry["task_name"], "at": now},
        )
        added_seconds = 0.0 if seconds is None else max(float(seconds) - row.seconds, 0.0)
        row.cost += float(cost)
        row.tokens += int(tokens)
        row.seconds += added_seconds
        row.at = now
        row.save(update_fields=["cost", "tokens", "seconds", "at"])
        run.cost += float(cost)
        run.tokens += int(tokens)
        run.seconds += added_seconds
        fields = ["cost", "tokens", "seconds"]
        stopped_by = "" if run.exhausted_by else _crossed(run)
        rejected: list[Finished] = []
        if stopped_by:
            run.exhausted_by, run.exhausted_at = stopped_by, now
            fields += ["exhausted_by", "exhausted_at"]
        run.save(update_fields=fields)
        if stopped_by:
            rejected, needs = _stop_waiting(run, now)
    follow_up(needs)
    return Charged(
        run=run.root_id,
        seconds=run.seconds,
        cost=run.cost,
        tokens=run.tokens,
        stopped_by=stopped_by,
        rejected=len(rejected),
    )


def _run_entries(run_id: str) -> Q:
    return Q(root_id=run_id) | Q(key=run_id)


def _stop_waiting(run: RunBudget, now: datetime) -> tuple[list[Finished], set[str]]:
    """End the run's waiting entries ``rejected`` (reason ``budget``), under the run's lock.

    Locks every pool of the run's *unfinished* entries, not only the waiting ones: a held
    entry goes back to waiting only under its pools' locks (a lost lease), so once they are
    held here the waiting set read below is complete. (A requeue after this commits finds
    the run stopped: :func:`rejects_requeue`.) The set of unfinished entries cannot grow
    meanwhile: enqueues of the run wait for its budget row.
    """
    unfinished = list(
        QueueEntry.objects.filter(_run_entries(run.root_id))
        .filter(state__in=(EntryState.WAITING, EntryState.ADMITTED, EntryState.RUNNING))
        .values_list("demand", flat=True)
    )
    names = sorted({name for demand in unfinished for name in demand})
    if not names:
        return [], set()
    stop = stop_of(run)
    with locking.locked_pools(names) as pools:
        waiting = list(QueueEntry.objects.waiting().filter(_run_entries(run.root_id)))
        if not waiting:
            return [], set()
        finished = [
            replace(f, budget=stop)
            for f in finish_waiting(waiting, EntryState.REJECTED, now, reason=BUDGET)
        ]
        needs = admit_in(pools, now, finished)
    return finished, needs


def rejects_requeue(entry: QueueEntry) -> BudgetStop | None:
    """For an entry going back in line: the stop of its run if the run has spent a budget.

    Called under the entry's pool locks by :func:`pools.core.settling.requeue`; reads the
    budget row only for entries of runs with a budget (their ``options`` say so).
    """
    run_id = (entry.options or {}).get(BUDGET_OPTION)
    if not run_id:
        return None
    run = RunBudget.objects.filter(root_id=run_id).exclude(exhausted_by="").first()
    return stop_of(run) if run is not None else None


@dataclass(frozen=True, kw_only=True)
class Spend:
    """A run's budget and what it has spent (the run panel, ``pools.run_spend()``)."""

    run: str
    limits: dict[str, float]
    spent: dict[str, float]
    stopped_by: str
    stopped_at: datetime | None
    #: Charge rows (attempts that reported something).
    attempts: int


def spend(run_id: str) -> Spend | None:
    """The budget and spend of run ``run_id``; ``None`` when it has no budget."""
    run = RunBudget.objects.filter(root_id=run_id).first()
    if run is None:
        return None
    return Spend(
        run=run.root_id,
        limits={k: float(v) for k in BUDGET_KINDS if (v := getattr(run, f"max_{k}")) is not None},
        spent={k: float(getattr(run, k)) for k in BUDGET_KINDS},
        stopped_by=run.exhausted_by,
        stopped_at=run.exhausted_at,
        attempts=Charge.objects.filter(run=run).count(),
    )


__all__ = [
    "Charged",
    "Spend",
    "charge",
    "exceeded",
    "has_budget",
    "lock_for_enqueue",
    "may_have_budget",
    "open_run",
    "rejects_requeue",
    "run_id_of",
    "spend",
    "stop_of",
]
