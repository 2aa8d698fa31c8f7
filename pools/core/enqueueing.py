"""Enqueue on the ORM engine: refusals, idempotency, the overflow drop, the entry and its
line rows, and the admission pass, under the locks of the submit's pools.

The contract is ``docs/concepts/contract.md`` (enqueue, refusal precedence). The
public service is :func:`pools.core.admission.enqueue`.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from pools.core import budgets, dispatch, events, strategies
from pools.core.admission_pass import admit_locked, note_due
from pools.core.ending import finish_waiting
from pools.core.locking import locked_pools, unavailable_on_error
from pools.core.pass_runs import follow_up, requeue_unpublished, still_needed
from pools.core.records import BUDGET_OPTION, Enqueued, Finished, Submission
from pools.core.supersession import end_waiting_of_job, supersede_on_enqueue
from pools.exceptions import (
    DemandExceedsCapacity,
    PoolDraining,
    PoolFull,
    PoolPaused,
    UnknownPool,
)
from pools.models import Demand, OverflowPolicy, PausedPolicy, Pool, QueueEntry
from pools.states import DELAYED, HELD_STATES, EntryState, EventKind

#: Named in the database's message when a second unfinished entry takes an idempotency key
#: (the column on SQLite, the unique constraint on PostgreSQL and MariaDB).
IDEMPOTENCY_COLUMN = "idempotency_active"


class NeedsLocks(Exception):
    """A full pool would drop one of its entries (overflow policy): only under its lock."""


def enqueue_with_locks(
    sub: Submission, now: datetime, deadline: datetime | None, *, budgeted: bool
) -> Enqueued:
    """:func:`pools.core.admission.enqueue` under the pools' locks (and the run's, when
    ``budgeted``): an idempotency key held by an unfinished entry returns that entry."""
    key = sub.idempotency_key
    if key is not None:
        with unavailable_on_error(f"pools {', '.join(sorted(sub.spec.demand))}"):
            existing = holder_of(key, other_than=sub.key)
        if existing is not None:
            return existing
    locked = enqueue_in_budgeted_run if budgeted else enqueue_locked
    for _ in range(2):
        try:
            return locked(sub, now, deadline)
        except IntegrityError as exc:
            if key is None or IDEMPOTENCY_COLUMN not in str(exc):
                raise
        # Another submit with the same key committed first: hand back its entry.
        existing = holder_of(key, other_than=sub.key)
        if existing is not None:
            return existing
        now = timezone.now()  # it finished meanwhile: the key is free again, try once more
    raise IntegrityError(f"idempotency key {key!r} stayed taken by an entry that finished")


def holder_of(key: str, *, other_than: str = "") -> Enqueued | None:
    """The unfinished entry holding idempotency ``key`` (as a non-created :class:`Enqueued`).

    ``other_than`` (a Celery task id) is ignored: a retry takes its key over from the
    attempt that sends it.
    """
    row = (
        QueueEntry.objects.filter(idempotency_active=key)
        .exclude(key=other_than)
        .values_list("queue_id", "key", "state")
        .first()
    )
    if row is None:
        return None
    return Enqueued(
        entry_id=row[0], key=row[1], admitted=False, created=False, existing_state=row[2]
    )


def enqueue_in_budgeted_run(sub: Submission, now: datetime, deadline: datetime | None) -> Enqueued:
    """:func:`enqueue` of a task of a run with a budget: the run's row is locked first.

    Raises :class:`~pools.exceptions.BudgetExceeded` when the run has spent a budget. Taken
    before the pool locks (the order :mod:`pools.core.budgets` documents), so the charge
    that stops the run and this enqueue are serialized: no entry joins a stopped run's line.
    Always the Python path (the fast-path functions do not know budgets).
    """
    with unavailable_on_error(f"run {budgets.run_id_of(sub)!r}"), transaction.atomic():
        run = budgets.lock_for_enqueue(sub, now)
        if run is None:  # cannot happen after has_budget(), unless the row was deleted
            return enqueue_locked(sub, now, deadline)
        options = {**sub.options, BUDGET_OPTION: run.root_id}
        return enqueue_locked(replace(sub, options=options), now, deadline)


def enqueue_locked(sub: Submission, now: datetime, deadline: datetime | None) -> Enqueued:
    """:func:`enqueue` on the Python path: the refusals, the overflow drop and the pass."""
    spec = sub.spec
    with locked_pools(spec.demand) as pools:
        dropped = refuse(spec.demand, pools, now)
        if sub.attempt and sub.idempotency_key is not None:
            # A retry is sent by its running attempt, which holds the key: the key moves on.
            QueueEntry.objects.filter(
                key=sub.key, idempotency_key=sub.idempotency_key, state__in=HELD_STATES
            ).update(idempotency_key=None)
        entry = create_entry(sub, now, deadline)
        delayed = sub.not_before is not None and sub.not_before > now
        joins = sub.not_before if delayed and sub.not_before else now
        rows = demand_rows(sub, entry, pools, joins, delayed=delayed)
        Demand.objects.bulk_create(rows)
        events.transition(EventKind.ENQUEUED, [entry], at=now)
        if delayed and sub.not_before is not None:
            note_due(pools, spec.demand, sub.not_before)
        superseded, elsewhere = supersede_on_enqueue(sub, entry, pools, now)
        step = admit_locked(pools, now)  # also schedules the wake-up of a delayed entry
        dispatch.after_commit(
            step.admissions,
            [*dropped, *superseded, *step.finished],
            step.wake,
            requeue=requeue_unpublished,
        )
    # Admitted by this call's own pass or by its follow-up pass (as on the fast path).
    admissions = [*step.admissions, *follow_up(still_needed(step, pools))]
    if elsewhere is not None:  # older entries of the job in other pools (a changed demand)
        end_waiting_of_job(sub.job, **elsewhere)
    return Enqueued(
        entry_id=entry.queue_id,
        key=entry.key,
        admitted=any(a.entry_id == entry.queue_id for a in admissions),
    )


def create_entry(sub: Submission, now: datetime, deadline: datetime | None) -> QueueEntry:
    """The entry row of a submit (its line rows are :func:`demand_rows`)."""
    return QueueEntry.objects.create(**entry_fields(sub, now, deadline))


def entry_fields(sub: Submission, now: datetime, deadline: datetime | None) -> dict[str, Any]:
    """The columns of a submit's entry row (one insert, or a batch's bulk insert)."""
    return dict(
        key=sub.key,
        task_name=sub.task_name,
        args=shown(sub.args),
        kwargs=shown(sub.kwargs),
        options=sub.options,
        demand=dict(sub.spec.demand),
        priority=sub.spec.priority,
        enqueued_at=now,
        not_before=sub.not_before,
        deadline=deadline,
        origin=sub.origin,
        root_id=sub.root_id or "",
        parent_id=sub.parent_id or "",
        attempt=sub.attempt,
        job=sub.job,
        concurrency_policy=sub.concurrency_policy,
        pinned_worker=sub.pinned_worker,
        idempotency_key=sub.idempotency_key,
        fairness_key=sub.fairness_key,
        debounce_key=sub.debounce_key,
    )


def demand_rows(
    sub: Submission, entry: QueueEntry, pools: dict[str, Pool], joins: datetime, *, delayed: bool
) -> list[Demand]:
    """One unsaved line row per pool of the entry, placed by each pool's strategy at ``joins``
    (out of line, ``delayed``, until ``joins`` when ``delayed``)."""
    rows = []
    for name, slots in sub.spec.demand.items():
        line_round, line_at, fairness_key = strategies.place(
            pools[name], priority=sub.spec.priority, at=joins, key=sub.fairness_key, delayed=delayed
        )
        rows.append(
            Demand(
                entry=entry,
                pool=pools[name],
                slots=slots,
                state=DELAYED if delayed else EntryState.WAITING,
                priority=sub.spec.priority,
                enqueued_at=joins,
                line_round=line_round,
                line_at=line_at,
                fairness_key=fairness_key,
            )
        )
    return rows


def refuse(
    demand: dict[str, int], pools: dict[str, Pool], now: datetime, *, drop: bool = True
) -> list[Finished]:
    """Raise the refusal that wins (docs/concepts/contract.md), if any; under the locks.

    Precedence: an unknown pool, then a demand above a pool's capacity, then a pool paused
    with ``paused_policy="reject"`` (not one in backoff: it queues), then a draining pool, then a full backlog whose
    overflow policy is ``reject``; within each, the first pool by name.
    The enqueue function of the fast path does the same, and hands the policies to this function.
    A full backlog with ``drop_oldest`` / ``drop_newest`` drops one waiting entry
    instead (returned, already ended ``rejected``); with ``drop=False`` (no locks held) it
    raises :class:`NeedsLocks` instead.
    """
    names = sorted(demand)
    for name in names:
        if name not in pools:
            raise UnknownPool(name)
    for name in names:
        if demand[name] > pools[name].slots:
            raise DemandExceedsCapacity(name, demand[name], pools[name].slots)
    for name in names:
        pool = pools[name]
        # A backoff (pools.core.backoffs) is a pause that queues whatever the policy: the
        # partner asked for time, not for the work to be refused.
        if pool.paused and pool.paused_policy == PausedPolicy.REJECT and pool.backoff_until is None:
            raise PoolPaused(name)
    for name in names:
        pool = pools[name]
        if pool.pending_slots is not None:
            raise PoolDraining(name, pool.pending_slots, Demand.objects.line(pool.pk).count())
    victims: list[tuple[Pool, QueueEntry]] = []
    for name in names:
        pool = pools[name]
        if pool.max_queued is not None and _line_reaches(pool, pool.max_queued):
            victim = None
            if pool.overflow != OverflowPolicy.REJECT and not drop:
                raise NeedsLocks(name)
            if pool.overflow != OverflowPolicy.REJECT:
                victim = _overflow_victim(pool, pools, {e.queue_id for _, e in victims})
            if victim is None:
                raise PoolFull(name, pool.max_queued)
            victims.append((pool, victim))
    dropped: list[Finished] = []
    for pool, victim in victims:
        reason = (
            f"dropped by overflow policy {pool.overflow}: pool {pool.name!r} was full "
            f"(max_queued={pool.max_queued})"
        )
        dropped += [
            replace(f, pool=pool.name, dropped_at=pool.max_queued)
            for f in finish_waiting([victim], EntryState.REJECTED, now, reason=reason)
        ]
    return dropped


#: How many of a full pool's oldest/newest entries are looked at for one it can drop.
VICTIM_SCAN = 50


def _overflow_victim(pool: Pool, pools: dict[str, Pool], taken: set[int]) -> QueueEntry | None:
    """The waiting entry a full pool's overflow policy drops: its oldest or newest entry.

    Only an entry whose pools are all locked by this call can be ended here (a multi-pool
    entry naming another pool is passed over); ``None`` when there is none.
    """
    order = "entry_id" if pool.overflow == OverflowPolicy.DROP_OLDEST else "-entry_id"
    rows = Demand.objects.queued().filter(pool_id=pool.pk).select_related("entry").order_by(order)
    for row in rows[:VICTIM_SCAN]:
        entry: QueueEntry = row.entry
        if entry.queue_id not in taken and set(entry.demand) <= pools.keys():
            return entry
    return None


def shown(value: Any) -> Any:
    """Arguments as stored for display: a repr string as it is, else list/dict data."""
    if isinstance(value, str):
        return value.replace("\x00", "\\x00")  # PostgreSQL text holds no NUL character
    return dict(value) if isinstance(value, dict) else list(value)


def deadline_of(sub: Submission, now: datetime) -> datetime | None:
    """The earlier of the ``queue_timeout`` deadline (counted from when the entry is due)
    and Celery's ``expires``."""
    deadline = None
    if sub.spec.queue_timeout is not None:
        deadline = max(now, sub.not_before or now) + timedelta(seconds=sub.spec.queue_timeout)
    if sub.expires is not None and (deadline is None or sub.expires < deadline):
        deadline = sub.expires
    return deadline


def _line_reaches(pool: Pool, count: int) -> bool:
    """True if the pool has at least ``count`` waiting entries (reads at most ``count`` rows)."""
    if count <= 0:
        return True
    return Demand.objects.queued().filter(pool_id=pool.pk).order_by()[count - 1 : count].exists()
