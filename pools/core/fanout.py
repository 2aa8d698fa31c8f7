"""Fan-out: many submits in one transaction (``pools.enqueue_many``, a group's members).

A batch is atomic, like ``bulk_create``: every call is enqueued, or none is and the
refusal the first refused call would get is raised (a batch that does not fit in a pool's
``max_queued`` as a whole is refused with :class:`~pools.exceptions.PoolFull`). Nothing
is written when it raises.

The common batch (plain calls of the same pools) takes one transaction: the locks of
every pool the batch names, in name order (:mod:`pools.core.locking`), the refusals
once per distinct demand, the entry rows and line rows inserted in chunks of
:data:`CHUNK`, and one admission pass. What that path does not decide in bulk runs one
call at a time inside one outer transaction, with the single-call services
(:func:`pools.core.admission.enqueue`), so the batch stays atomic and every rule of a
single call holds: a run with a budget, a ``replace`` job or a beat fire (they end other
entries), a retry, a ``fair`` pool (each call's round depends on the one before), a full
pool whose overflow policy drops entries, a call inside the caller's own transaction,
and a database that cannot return the ids of a bulk insert (MySQL; MariaDB can).

Both engines run a batch here: on PostgreSQL the stored enqueue function takes one call
per round trip, and one ORM transaction for the whole batch is what saves the time
(docs/benchmarks.md, "Fan-out in one transaction").
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import datetime

from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from pools.core import admission, budgets, dispatch, events
from pools.core.admission_pass import admit_locked, note_due
from pools.core.enqueueing import (
    IDEMPOTENCY_COLUMN,
    NeedsLocks,
    _line_reaches,
    deadline_of,
    demand_rows,
    entry_fields,
    refuse,
)
from pools.core.in_transaction import in_callers_transaction
from pools.core.locking import bounded, locked_pools, unavailable_on_error
from pools.core.pass_runs import follow_up, requeue_unpublished, still_needed
from pools.core.records import Admission, Enqueued, Submission
from pools.core.supersession import supersedes
from pools.exceptions import PoolFull
from pools.models import Demand, EventKind, OverflowPolicy, Pool, QueueEntry, Strategy

#: Entry rows (and their line rows) per insert statement: the memory a batch holds in
#: ORM objects at once, whatever its size.
CHUNK = 500


class OneByOne(Exception):
    """The batch needs the single-call rules (see the module docstring)."""


def enqueue_many(subs: Sequence[Submission]) -> list[Enqueued]:
    """Enqueue ``subs`` atomically; one :class:`Enqueued` per submit, in order.

    Raises what :func:`pools.core.admission.enqueue` raises for a single call; then
    nothing of the batch is written.
    """
    if not subs:
        return []
    if in_callers_transaction() or not batchable(subs):
        return one_by_one(subs)
    try:
        return in_one_transaction(subs)
    except OneByOne:
        return one_by_one(subs)
    except IntegrityError as exc:
        if IDEMPOTENCY_COLUMN not in str(exc):
            raise
        # A concurrent submit took one of the keys first: the single-call rules hand
        # back its entry.
        return one_by_one(subs)


def batchable(subs: Sequence[Submission]) -> bool:
    """Whether no submit of ``subs`` needs the single-call rules before any lock is taken."""
    if not connection.features.can_return_rows_from_bulk_insert:
        return False
    runs: set[str] = set()
    for sub in subs:
        if sub.attempt or supersedes(sub) or sub.spec.budget is not None or sub.debounce_key:
            return False
        if budgets.may_have_budget(sub):
            runs.add(budgets.run_id_of(sub))
    return not any(budgets.has_budget(run) for run in runs)  # a group: its one run


def one_by_one(subs: Sequence[Submission]) -> list[Enqueued]:
    """Each submit by the single-call service, all in one outer transaction (atomic)."""
    with unavailable_on_error("enqueueing a batch"), transaction.atomic():
        return [admission.enqueue(sub) for sub in subs]


def in_one_transaction(subs: Sequence[Submission]) -> list[Enqueued]:
    """The batch in one transaction: bulk inserts, one lock of its pools, one pass.

    The entry rows (the wide ones: each holds its message) are inserted before the pool
    locks are taken, in the same transaction: no other transaction sees them, and without
    line rows no admission pass would look at them anyway. Under the locks: the
    refusals, the line rows and the pass, so the pools are held for the narrow part
    only. A batch with idempotency keys inserts its entries under the locks, as a single
    call does: an entry taking a key waits for another uncommitted one holding it, and
    waiting so before the locks could deadlock with that call.
    """
    now = timezone.now()
    known, new = _keys_resolved(subs)
    names = sorted({name for sub in subs for name in sub.spec.demand})
    early = all(subs[i].idempotency_key is None for i in new)
    created: dict[int, tuple[int, str]] = {}  # index in subs -> (entry id, key)
    with bounded(f"pools {', '.join(names)}"):
        if early:
            _insert_entries(subs, new, now, created)
        with locked_pools(names) as pools:
            _refuse_batch([subs[i] for i in new], pools, now)
            if not early:
                _insert_entries(subs, new, now, created)
            for name, when in _insert_line_rows(subs, new, pools, now, created).items():
                note_due(pools, [name], when)
            step = admit_locked(pools, now)
            dispatch.after_commit(
                step.admissions, step.finished, step.wake, requeue=requeue_unpublished
            )
    admissions: list[Admission] = [*step.admissions, *follow_up(still_needed(step, pools))]
    admitted = {a.entry_id for a in admissions}
    out: list[Enqueued] = []
    for i in range(len(subs)):
        if i in created:
            entry_id, key = created[i]
            out.append(Enqueued(entry_id=entry_id, key=key, admitted=entry_id in admitted))
            continue
        held = known[i]
        if isinstance(held, int):  # a key taken by an earlier call of this batch
            entry_id, key = created[held]
            held = Enqueued(
                entry_id=entry_id, key=key, admitted=False, created=False, existing_state="waiting"
            )
        out.append(held)
    return out


def _insert_entries(
    subs: Sequence[Submission], new: list[int], now: datetime, created: dict[int, tuple[int, str]]
) -> None:
    """The entry rows of ``subs[new]``, :data:`CHUNK` per insert; their ids into ``created``."""
    for chunk in _chunks(new):
        entries = QueueEntry.objects.bulk_create(
            [QueueEntry(**entry_fields(subs[i], now, deadline_of(subs[i], now))) for i in chunk]
        )
        for i, entry in zip(chunk, entries, strict=True):
            created[i] = (entry.queue_id, entry.key)
        events.transition(EventKind.ENQUEUED, entries, at=now)


def _insert_line_rows(
    subs: Sequence[Submission],
    new: list[int],
    pools: dict[str, Pool],
    now: datetime,
    created: dict[int, tuple[int, str]],
) -> dict[str, datetime]:
    """The line rows of the new entries (pools' locks held); returns, per pool, when its
    first delayed entry (an ``eta`` ahead) is due."""
    due: dict[str, datetime] = {}
    for chunk in _chunks(new):
        rows: list[Demand] = []
        for i in chunk:
            sub = subs[i]
            delayed = sub.not_before is not None and sub.not_before > now
            joins = sub.not_before if delayed and sub.not_before else now
            entry = QueueEntry(queue_id=created[i][0])  # only its id is written
            rows += demand_rows(sub, entry, pools, joins, delayed=delayed)
            if delayed:
                for name in sub.spec.demand:
                    due[name] = min(due.get(name, joins), joins)
        Demand.objects.bulk_create(rows)
    return due


def _keys_resolved(subs: Sequence[Submission]) -> tuple[dict[int, Enqueued | int], list[int]]:
    """Idempotency keys, as a single call resolves them before its locks.

    Returns the submits that create nothing (index -> the unfinished entry holding the
    key, or the index of the earlier call of this batch taking it) and the indexes of
    those that create an entry.
    """
    wanted = {sub.idempotency_key for sub in subs if sub.idempotency_key is not None}
    holders: dict[str, Enqueued] = {}
    if wanted:
        with unavailable_on_error("reading idempotency keys"):
            for row in QueueEntry.objects.filter(idempotency_active__in=wanted).values_list(
                "queue_id", "key", "state", "idempotency_active"
            ):
                holders[row[3]] = Enqueued(
                    entry_id=row[0],
                    key=row[1],
                    admitted=False,
                    created=False,
                    existing_state=row[2],
                )
    known: dict[int, Enqueued | int] = {}
    first: dict[str, int] = {}
    new: list[int] = []
    for i, sub in enumerate(subs):
        key = sub.idempotency_key
        if key is not None and key in holders and holders[key].key != sub.key:
            known[i] = holders[key]
        elif key is not None and key in first:
            known[i] = first[key]
        else:
            if key is not None:
                first[key] = i
            new.append(i)
    return known, new


def _refuse_batch(subs: Sequence[Submission], pools: dict[str, Pool], now: datetime) -> None:
    """The refusals of the batch, under its locks; :class:`OneByOne` for what they leave
    to the single-call rules (a ``fair`` pool, a full pool that drops entries)."""
    if any(
        pools[name].strategy == Strategy.FAIR
        for sub in subs
        for name in sub.spec.demand
        if name in pools
    ):
        raise OneByOne
    seen: set[tuple[tuple[str, int], ...]] = set()
    joining: dict[str, int] = {}
    for sub in subs:
        demand = tuple(sorted(sub.spec.demand.items()))
        if demand not in seen:  # the refusal the first call of this demand would get
            seen.add(demand)
            try:
                refuse(dict(sub.spec.demand), pools, now, drop=False)
            except NeedsLocks:
                raise OneByOne from None
        for name in sub.spec.demand:
            joining[name] = joining.get(name, 0) + 1
    for name in sorted(joining):
        pool = pools[name]
        if pool.max_queued is None:
            continue
        if _line_reaches(pool, pool.max_queued - joining[name] + 1):
            if pool.overflow != OverflowPolicy.REJECT:
                raise OneByOne
            raise PoolFull(name, pool.max_queued)


def _chunks(indexes: list[int]) -> Iterator[list[int]]:
    for start in range(0, len(indexes), CHUNK):
        yield indexes[start : start + CHUNK]
