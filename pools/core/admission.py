"""Admission: the ORM path of every state change of a waiting or held entry.

Row locks are taken through :mod:`pools.core.locking` (pool rows ``FOR UPDATE`` in name
order, then entry and demand rows of those pools), so no transaction can deadlock another.

Invariant protected: for every pool, the slots held by its admitted and running
entries never exceed its capacity. Every change to a *waiting* or *held* entry
(enqueue, admit, settle, cancel, requeue, expire) runs with the locks of all the
pools the entry names, so the sum computed under the lock is exact. On SQLite
``select_for_update`` is a no-op and the database must run ``IMMEDIATE``
transactions (``OPTIONS={"transaction_mode": "IMMEDIATE"}``), which serialize writers.

Order of admission: the pool's strategy (:mod:`pools.core.strategies`): by default
priority descending, then ``enqueued_at``, then ``queue_id``.
A pool's head waits until all of its slots are free and blocks everything behind it
(no backfill). A multi-pool entry is admitted only where it is the head of every
pool it names, and then acquires all of them at once.

Time is different: an entry whose ``not_before`` (countdown, ETA, retry delay) is
ahead is not in line (its demand rows are ``delayed``) and blocks nothing. The first
admission pass after it is due moves it into line as if it had been sent then
(``enqueued_at`` = its due time), and a timed wake-up makes that pass happen on time.

Transactions are short: task bodies and broker publishes run after commit
(:mod:`pools.core.dispatch`).

This module is the ORM path of the admission contract (``docs/concepts/contract.md``:
preconditions, refusal precedence, bound, rows and events per operation); the stored
functions of :mod:`pools.pg.fastpath` are the other, and ``tests/integration/
test_differential.py`` holds the two to it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, connection, transaction
from django.db.models import Case, Exists, F, OuterRef, Q, Value, When
from django.utils import timezone

from pools import conf
from pools.core import (
    budgets,
    dispatch,
    eligibility,
    events,
    nodes,
    spendcap,
    strategies,
    windows,
)
from pools.core.locking import locked_pools, parent_rows_unlocked, unavailable_on_error
from pools.core.records import (
    BUDGET,
    BUDGET_OPTION,
    EXPIRES,
    QUEUE_TIMEOUT,
    Admission,
    Enqueued,
    Finished,
    Submission,
)
from pools.exceptions import (
    DemandExceedsCapacity,
    EntryNotFound,
    NotCancellable,
    PoolDraining,
    PoolFull,
    PoolPaused,
    PoolUnavailable,
    UnknownPool,
)
from pools.models import (
    DELAYED,
    HELD_STATES,
    ConcurrencyPolicy,
    Demand,
    EntryState,
    EventKind,
    Origin,
    OverflowPolicy,
    PausedPolicy,
    Pool,
    QueueEntry,
)
from pools.pg import fastpath, functions
from pools.specs import NAMED_RANK, gate_rank

logger = logging.getLogger("pools.admission")

#: ``reason`` of a held entry whose termination was requested (``cancel(terminate=True)``).
TERMINATING = "terminating"
#: At most this many line rows are read per pool per round of an admission pass.
LINE_BATCH = 200
#: Bound on follow-up passes when a multi-pool head needs pools that were not locked.
MAX_PASSES = 4
#: At most this many entries held back by a workflow cap are passed over per named pool
#: and pass (they are not in the named pools' lines until their caps have room; see
#: docs/howto/workflow-caps.md). Beyond it the pool waits, as behind any head.
CAP_PASS = 100
#: At most this many delayed entries join the line per admission pass (the rest next pass).
PROMOTE_BATCH = 500
#: Named in the database's message when a second unfinished entry takes an idempotency key
#: (the column on SQLite, the unique constraint on PostgreSQL and MariaDB).
IDEMPOTENCY_COLUMN = "idempotency_active"
#: Entries of one job ended per call of :func:`end_waiting_of_job` (the next call takes the rest).
JOB_BATCH = 500

logger = logging.getLogger("pools.core.admission")


@dataclass(kw_only=True)
class _Pass:
    admissions: list[Admission] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)
    #: Pools named by a blocked multi-pool head that this pass had not locked.
    needs: set[str] = field(default_factory=set)
    #: Pools whose head waits for its ``not_before``: when to run admission again.
    wake: dict[str, datetime] = field(default_factory=dict)


def _held_by_pool(pools: dict[int, Pool]) -> dict[int, int]:
    """Slots held in each (locked) pool: its ``held`` counter, read with the lock."""
    return {pid: pool.held for pid, pool in pools.items()}


def _change_held(
    pools: dict[str, Pool], entries: Iterable[QueueEntry], sign: int, *, admitted: bool = False
) -> dict[int, int]:
    """Add (``sign`` +1) or release (-1) the entries' slots in the locked pools' counters.

    One UPDATE, in the transaction that changes the holders, with the row locks held; the
    in-memory rows follow, so a pass later in the same transaction reads the new value.
    With ``admitted=True`` the entries were just admitted, in this order: each pool's
    ``admissions`` count goes up by its entries, and the result maps each entry id to its
    ``admission_seq`` (the count of its first pool by name after it).
    """
    changes: dict[str, int] = {}
    counted: dict[str, int] = {}
    seq: dict[int, int] = {}
    for entry in entries:
        for name in sorted(entry.demand):
            if name not in pools:
                continue
            changes[name] = changes.get(name, 0) + sign * entry.demand[name]
            if admitted:
                counted[name] = counted.get(name, 0) + 1
                seq.setdefault(entry.queue_id, pools[name].admissions + counted[name])
    changed = {name for name, n in changes.items() if n} | set(counted)
    if not changed:
        return seq
    ids = {name: pools[name].pk for name in changed}
    update: dict[str, Any] = {
        "held": F("held")
        + Case(
            *(When(pk=ids[name], then=Value(changes.get(name, 0))) for name in changed),
            default=Value(0),
        )
    }
    if counted:
        update["admissions"] = F("admissions") + Case(
            *(When(pk=ids[name], then=Value(n)) for name, n in counted.items()),
            default=Value(0),
        )
    Pool.objects.filter(pk__in=list(ids.values())).update(**update)
    for name in changed:
        pools[name].held += changes.get(name, 0)
        pools[name].admissions += counted.get(name, 0)
    return seq


# --------------------------------------------------------------------------- admission pass


def _admit_locked(pools: dict[str, Pool], now: datetime) -> _Pass:
    """Admit every entry that fits, in line order, in the pools locked by the caller."""
    result = _Pass()
    by_id = {p.pk: p for p in pools.values()}
    held = _held_by_pool(by_id)
    free = {pid: p.slots - held.get(pid, 0) for pid, p in by_id.items()}
    lease = timedelta(seconds=conf.get().LEASE_SECONDS)
    _promote_due(pools, now, result)
    capped = spendcap.capped_names(pools.values())
    if capped:  # admits nothing today: look again when the next UTC day starts
        for name in capped:
            result.wake[name] = min(result.wake.get(name, spendcap.next_day()), spendcap.next_day())
    admitted: list[QueueEntry] = []
    expired: list[QueueEntry] = []
    done: set[int] = set()
    # Ineligible heads (forbid, pinned worker) stay so for the rest of the pass.
    ineligible: set[int] = set()
    admitted_jobs: set[str] = set()
    # Strategy ``fair``: the highest round admitted per pool in this pass.
    rounds: dict[int, int] = {}
    live: list[set[str]] = []

    def live_hostnames() -> set[str]:
        if not live:  # one query per pass, and only when a pinned head is looked at
            live.append(nodes.live_hostnames())
        return live[0]

    # Entries held back by a full workflow cap: not yet in their named pools' lines.
    passed: set[int] = set()
    passes: dict[int, int] = {}
    # Rate limits (pools.core.rates): checked with the slots, in line order.
    rated = windows.Windows(pools)
    caps = _CapRoom(pools, free, rated)

    while True:
        lines: dict[int, deque[Demand]] = {}
        full_batch: set[int] = set()
        for pid, pool in by_id.items():
            if pool.paused or free[pid] <= 0 or pool.name in capped:
                continue
            limit = min(free[pid] + (CAP_PASS if pid in passes else 0), LINE_BATCH)
            if pool.name in rated.rates:  # no more rows than its rates can admit now
                limit = min(limit, rated.room(pool.name))
            query = Demand.objects.line(pid).select_related("entry")
            if done or passed:  # rows handled earlier in this pass are not written back yet
                query = query.exclude(entry_id__in=done | passed)
            rows = list(query[:limit])
            lines[pid] = deque(rows)
            if len(rows) == limit:
                full_batch.add(pid)
        progress = False
        for pool in sorted(pools.values(), key=lambda p: p.name):
            line = lines.get(pool.pk)
            while line:
                if free[pool.pk] <= 0:
                    # A full pool's line is not looked at further (dead heads behind the
                    # last admission wait for the sweep): the same rule as the admit function,
                    # and not dependent on how many rows this pass happened to read.
                    break
                entry = line[0].entry
                if entry.queue_id in done:
                    line.popleft()
                    continue
                if entry.deadline is not None and entry.deadline <= now:
                    # Dead heads leave the line instead of blocking it.
                    expired.append(entry)
                    done.add(entry.queue_id)
                    _drop_from_lines(entry, pools, lines)
                    progress = True
                    continue
                if entry.queue_id in ineligible or (
                    eligibility.is_special(entry)
                    and eligibility.blocker(entry, live=live_hostnames, admitted_jobs=admitted_jobs)
                    is not None
                ):
                    # An ineligible head blocks its pool's lower entries
                    # (see docs/concepts/admission.md, Head-of-line blocking).
                    ineligible.add(entry.queue_id)
                    break
                if (
                    gate_rank(pool.name) == NAMED_RANK
                    and passes.get(pool.pk, 0) < CAP_PASS
                    and caps.holds_back(entry)
                ):
                    # Not through its cap yet: not in this pool's line (ordered gates).
                    passes[pool.pk] = passes.get(pool.pk, 0) + 1
                    passed.add(entry.queue_id)
                    line.popleft()
                    progress = True
                    continue
                if not _fits_everywhere(entry, pools, lines, free, result.needs):
                    break
                if rated.rates:
                    closed = rated.blocked(entry)
                    if closed:
                        # A head held back by a rate blocks its line (as one that does not
                        # fit); a pass over its pools runs when the last window opens.
                        when = rated.local(max(closed.values()))
                        for name in entry.demand:
                            result.wake[name] = min(result.wake.get(name, when), when)
                        break
                    rated.take(entry)
                for name, slots in entry.demand.items():
                    pid = pools[name].pk
                    free[pid] -= slots
                    rounds[pid] = max(rounds.get(pid, 0), lines[pid][0].line_round)
                _drop_from_lines(entry, pools, lines)
                done.add(entry.queue_id)
                admitted.append(entry)
                if entry.job:
                    admitted_jobs.add(entry.job)
                progress = True
        if not progress or not any(pid in full_batch and free[pid] > 0 for pid in lines):
            break

    if admitted:
        rated.write()  # before _mark_admitted moves the pools' admission counters on
        _mark_admitted(admitted, pools, now, now + lease)
        for pid, line_round in rounds.items():
            strategies.note_admitted(by_id[pid], line_round)
        result.admissions.extend(
            Admission(
                entry_id=e.queue_id,
                key=e.key,
                token=e.token,
                task_name=e.task_name,
                args=e.args,
                kwargs=e.kwargs,
                options=e.options,
            )
            for e in admitted
        )
    if expired:
        result.finished.extend(_expire(expired, now))
    for pool in pools.values():
        if pool.pending_slots is not None:
            _end_drain_if_empty(pool, now)
    return result


def _end_drain_if_empty(pool: Pool, now: datetime) -> None:
    """A draining pool whose line is empty takes its new capacity (under its lock).

    Delayed entries are not in line: they join it later, under the new capacity.
    """
    if pool.pending_slots is None or Demand.objects.line(pool.pk).exists():
        return
    before, after = pool.slots, pool.pending_slots
    Pool.objects.filter(pk=pool.pk).update(slots=after, pending_slots=None, updated_at=now)
    pool.slots, pool.pending_slots = after, None
    events.record_pool(
        EventKind.CAPACITY_CHANGED,
        pool.name,
        at=now,
        detail={"from": before, "to": after, "drained": True},
    )


def _promote_due(pools: dict[str, Pool], now: datetime, result: _Pass) -> None:
    """Delayed entries that are due join the line; note when the next one is due.

    A pool's ``next_due_at`` says when to look, so a pass over pools with nothing due
    costs no query. An entry joins only when all of its pools are locked (all its rows
    change at once); otherwise its other pools go to ``result.needs`` for a follow-up pass.
    """
    looked = [p for p in pools.values() if p.next_due_at is not None and p.next_due_at <= now]
    for pool in pools.values():
        if pool.next_due_at is not None and pool.next_due_at > now:
            result.wake[pool.name] = pool.next_due_at
    if not looked:
        return
    due = list(
        Demand.objects.due([p.pk for p in looked], now)
        .order_by("enqueued_at")
        .values_list("entry_id", flat=True)[:PROMOTE_BATCH]
    )
    if due:
        names: dict[int, set[str]] = {}
        for entry_id, name in Demand.objects.filter(entry_id__in=due).values_list(
            "entry_id", "pool__name"
        ):
            names.setdefault(entry_id, set()).add(name)
        ready = [e for e, wanted in names.items() if wanted <= pools.keys()]
        for wanted in names.values():
            result.needs |= wanted - pools.keys()
        if ready:
            Demand.objects.filter(entry_id__in=ready, state=DELAYED).update(
                state=EntryState.WAITING
            )
            strategies.join_rounds(pools, ready)
    for pool in looked:
        pool.next_due_at = (
            Demand.objects.delayed()
            .filter(pool_id=pool.pk)
            .order_by("enqueued_at")
            .values_list("enqueued_at", flat=True)
            .first()
        )
        Pool.objects.filter(pk=pool.pk).update(next_due_at=pool.next_due_at)
        if pool.next_due_at is not None:
            result.wake[pool.name] = pool.next_due_at


def _note_due(pools: dict[str, Pool], names: Iterable[str], when: datetime) -> None:
    """A delayed entry was put in these pools: bring their ``next_due_at`` forward."""
    for name in names:
        pool = pools[name]
        if pool.next_due_at is None or when < pool.next_due_at:
            pool.next_due_at = when
            Pool.objects.filter(pk=pool.pk).update(next_due_at=when)


def _expiry_reason(entry: QueueEntry) -> str:
    """``expired`` when Celery's ``expires`` set the deadline, else ``queue_timeout``."""
    expires = (entry.options or {}).get("expires")
    if expires and entry.deadline is not None:
        if entry.deadline >= datetime.fromisoformat(expires):
            return EXPIRES
    return QUEUE_TIMEOUT


def _expire(entries: list[QueueEntry], now: datetime) -> list[Finished]:
    """End waiting entries whose deadline passed, each with its reason."""
    by_reason: dict[str, list[QueueEntry]] = {}
    for entry in entries:
        by_reason.setdefault(_expiry_reason(entry), []).append(entry)
    finished: list[Finished] = []
    for reason, group in by_reason.items():
        finished += _finish_waiting(group, EntryState.EXPIRED, now, reason=reason)
    return finished


class _CapRoom:
    """Free slots of workflow-cap pools during a pass: from the pass for locked pools, read
    once (without a lock: it only orders, it never admits) for the others. A task pool
    whose rate has no room now (``@pooled(rate=...)``) holds its calls back as a full
    one does."""

    def __init__(
        self, pools: dict[str, Pool], free: dict[int, int], rated: windows.Windows
    ) -> None:
        self.pools = pools
        self.free = free
        self.rated = rated
        self.unlocked: dict[str, int] = {}

    def holds_back(self, entry: QueueEntry) -> bool:
        """True if a cap pool of ``entry`` has less room than the entry asks of it, or a
        rate without room now."""
        caps = {n: s for n, s in entry.demand.items() if gate_rank(n) < NAMED_RANK}
        if not caps:
            return False
        missing = [n for n in caps if n not in self.pools and n not in self.unlocked]
        if missing:
            for unlocked in Pool.objects.filter(name__in=missing).only(
                "name", "slots", "held", "rate", "admissions"
            ):
                room = unlocked.slots - unlocked.held
                if room > 0 and windows.next_opening(unlocked) is not None:
                    room = 0
                self.unlocked[unlocked.name] = room
        for name, slots in caps.items():
            pool = self.pools.get(name)
            room = self.free[pool.pk] if pool is not None else self.unlocked.get(name, 0)
            if room < slots or (pool is not None and self.rated.opens_at(name) is not None):
                return True
        return False


def _fits_everywhere(
    entry: QueueEntry,
    pools: dict[str, Pool],
    lines: dict[int, deque[Demand]],
    free: dict[int, int],
    needs: set[str],
) -> bool:
    for name, slots in entry.demand.items():
        pool = pools.get(name)
        if pool is None:
            needs.add(name)
            return False
        line = lines.get(pool.pk)
        if not line or line[0].entry_id != entry.queue_id or free[pool.pk] < slots:
            return False
    return True


def _drop_from_lines(
    entry: QueueEntry, pools: dict[str, Pool], lines: dict[int, deque[Demand]]
) -> None:
    for name in entry.demand:
        pool = pools.get(name)
        line = lines.get(pool.pk) if pool else None
        if line and line[0].entry_id == entry.queue_id:
            line.popleft()


def _mark_admitted(
    entries: list[QueueEntry], pools: dict[str, Pool], now: datetime, lease_until: datetime
) -> None:
    ids = [e.queue_id for e in entries]
    seq = _change_held(pools, entries, +1, admitted=True)
    changed = QueueEntry.objects.filter(pk__in=ids, state=EntryState.WAITING).update(
        state=EntryState.ADMITTED,
        token=F("token") + 1,
        admitted_at=now,
        lease_expires_at=lease_until,
        worker="",
        admission_seq=Case(*(When(pk=pk, then=Value(n)) for pk, n in seq.items())),
    )
    if changed != len(ids):  # pragma: no cover - would mean the lock order was broken
        raise RuntimeError(f"admission raced: {changed} of {len(ids)} entries changed under lock")
    Demand.objects.filter(entry_id__in=ids).update(state=EntryState.ADMITTED)
    for e in entries:
        e.token += 1
        e.state = EntryState.ADMITTED
    events.transition(EventKind.ADMITTED, entries, at=now)


def _finish_waiting(
    entries: list[QueueEntry],
    state: EntryState,
    now: datetime,
    *,
    reason: str,
    actor: str | None = None,
) -> list[Finished]:
    ids = [e.queue_id for e in entries]
    QueueEntry.objects.filter(pk__in=ids, state=EntryState.WAITING).update(
        state=state, finished_at=now, reason=reason
    )
    Demand.objects.filter(entry_id__in=ids).update(state=state)
    kinds: dict[EntryState, EventKind] = {
        EntryState.EXPIRED: EventKind.EXPIRED,
        EntryState.CANCELLED: EventKind.CANCELLED,
        EntryState.SUPERSEDED: EventKind.SUPERSEDED,
    }
    kind = kinds.get(state, EventKind.REJECTED)
    events.record(kind, entries, at=now, detail={"reason": reason}, actor=actor)
    return [
        Finished(
            entry_id=e.queue_id,
            key=e.key,
            task_name=e.task_name,
            state=state,
            pool=next(iter(e.demand)),
            deadline=e.deadline,
            options=e.options,
            reason=reason,
        )
        for e in entries
    ]


def _run_pass(names: Iterable[str]) -> _Pass:
    """Run admission over ``names`` (follow-up passes for multi-pool heads included)."""
    total = _Pass()
    todo = set(names)
    for _ in range(MAX_PASSES):
        if not todo:
            break
        with locked_pools(todo) as pools:
            step = _admit_locked(pools, timezone.now())
            dispatch.after_commit(
                step.admissions, step.finished, step.wake, requeue=_requeue_unpublished
            )
        total.admissions.extend(step.admissions)
        total.finished.extend(step.finished)
        todo = _still_needed(step, todo)
    return total


def _still_needed(step: _Pass, locked: Iterable[str]) -> set[str]:
    """Pools to run a follow-up pass over: empty unless a multi-pool head lacked a lock."""
    locked = set(locked)
    return locked | step.needs if step.needs - locked else set()


def _admit_in(pools: dict[str, Pool], now: datetime, finished: Sequence[Finished] = ()) -> set[str]:
    """Admission pass inside the caller's locked transaction; dispatch happens on commit.

    Returns the pools a follow-up pass must cover (see :func:`_follow_up`).
    """
    step = _admit_locked(pools, now)
    dispatch.after_commit(
        step.admissions, [*finished, *step.finished], step.wake, requeue=_requeue_unpublished
    )
    return _still_needed(step, pools)


def _follow_up(needs: set[str]) -> list[Admission]:
    """After commit: admit multi-pool heads whose pools were not all locked.

    The caller's own change has committed: a failure here (pool state unavailable, a bug)
    is not the caller's, so it is logged and the pass is left to a wake-up instead.
    """
    if not needs:
        return []
    try:
        return _run_pass(needs).admissions
    except Exception as exc:
        _admit_later(needs, exc)
        return []


def _admit_later(names: Iterable[str], exc: BaseException) -> None:
    """An admission pass that runs after the caller's change committed has failed: ask for
    another one at once (a timed wake-up; the sweep is the safety net), and do not fail the
    caller, whose own change stands."""
    pools = sorted(names)
    logger.warning(
        "Admission pass over pools %s after a committed change failed (%s); a wake-up runs it again",
        ", ".join(pools),
        exc,
    )
    if transaction.get_connection().in_atomic_block:  # a caller's transaction: after it
        transaction.on_commit(lambda: dispatch.wake(pools, timezone.now()))
    else:
        dispatch.wake(pools, timezone.now())


def _requeue_unpublished(admission: Admission, reason: str) -> None:
    """After-commit work failed before ``admission``'s message was handed to the broker: put
    it back in line at once (``dispatch.after_commit``'s ``requeue``), not at lease lapse."""
    try:
        requeue(
            admission.entry_id, admission.token, reason=reason[:255], admit=False, unstarted=True
        )
    except Exception:
        logger.exception("Could not requeue entry %s; its lease will lapse", admission.entry_id)


def admit(names: Iterable[str]) -> list[Admission]:
    """Run an admission pass over the named pools; returns what was admitted."""
    return _run_pass(names).admissions


def admit_all() -> list[Admission]:
    """Run an admission pass over every pool (sweeps, capacity changes)."""
    names = list(Pool.objects.filter(paused=False).values_list("name", flat=True))
    return _run_pass(names).admissions


# --------------------------------------------------------------------------- services


def enqueue(sub: Submission) -> Enqueued:
    """Put a call in line and admit whatever fits (the fast path), in one transaction.

    Raises :class:`UnknownPool`, :class:`DemandExceedsCapacity`, :class:`PoolPaused`,
    :class:`PoolDraining`, :class:`PoolFull` or :class:`PoolUnavailable`; nothing is written
    when it raises. A full pool whose overflow policy drops an entry drops it instead.

    A submit with an idempotency key (``skip``: its job's) that matches an unfinished entry
    creates nothing and returns that entry (``created=False``); the database's unique index
    decides between concurrent submits. Submits with a job, a policy, a key or a pinned
    worker take the Python path on every database (the PostgreSQL functions insert plain
    entries only; they also hand any enqueue a pool policy decides to the Python path).
    """
    now = timezone.now()
    deadline = _deadline(sub, now)
    budgeted = budgets.may_have_budget(sub) and bool(
        sub.spec.budget or budgets.has_budget(budgets.run_id_of(sub))
    )
    if not budgeted and _in_callers_transaction():  # no pool lock until the caller commits
        written = _enqueue_in_callers_transaction(sub, now, deadline)
        if written is not None:
            return written
    # A task of a run with a budget takes the Python path: its run's row is locked first.
    if sub.plain and not budgeted and fastpath.enabled():
        enqueued = _enqueue_in_one_call(sub, now, deadline)
        if enqueued is not None:
            return enqueued
    key = sub.idempotency_key
    if key is not None:
        with unavailable_on_error(f"pools {', '.join(sorted(sub.spec.demand))}"):
            existing = holder_of(key, other_than=sub.key)
        if existing is not None:
            return existing
    locked = _enqueue_in_budgeted_run if budgeted else _enqueue_locked
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


def _enqueue_in_budgeted_run(sub: Submission, now: datetime, deadline: datetime | None) -> Enqueued:
    """:func:`enqueue` of a task of a run with a budget: the run's row is locked first.

    Raises :class:`~pools.exceptions.BudgetExceeded` when the run has spent a budget. Taken
    before the pool locks (the order :mod:`pools.core.budgets` documents), so the charge
    that stops the run and this enqueue are serialized: no entry joins a stopped run's line.
    Always the Python path (the fast-path functions do not know budgets).
    """
    with unavailable_on_error(f"run {budgets.run_id_of(sub)!r}"), transaction.atomic():
        run = budgets.lock_for_enqueue(sub, now)
        if run is None:  # cannot happen after has_budget(), unless the row was deleted
            return _enqueue_locked(sub, now, deadline)
        options = {**sub.options, BUDGET_OPTION: run.root_id}
        return _enqueue_locked(replace(sub, options=options), now, deadline)


def _enqueue_locked(sub: Submission, now: datetime, deadline: datetime | None) -> Enqueued:
    """:func:`enqueue` on the Python path: the refusals, the overflow drop and the pass."""
    spec = sub.spec
    with locked_pools(spec.demand) as pools:
        dropped = _refuse(spec.demand, pools, now)
        if sub.attempt and sub.idempotency_key is not None:
            # A retry is sent by its running attempt, which holds the key: the key moves on.
            QueueEntry.objects.filter(
                key=sub.key, idempotency_key=sub.idempotency_key, state__in=HELD_STATES
            ).update(idempotency_key=None)
        entry = _create_entry(sub, now, deadline)
        delayed = sub.not_before is not None and sub.not_before > now
        joins = sub.not_before if delayed and sub.not_before else now
        rows = _demand_rows(sub, entry, pools, joins, delayed=delayed)
        Demand.objects.bulk_create(rows)
        events.transition(EventKind.ENQUEUED, [entry], at=now)
        if delayed and sub.not_before is not None:
            _note_due(pools, spec.demand, sub.not_before)
        superseded, elsewhere = _supersede_on_enqueue(sub, entry, pools, now)
        step = _admit_locked(pools, now)  # also schedules the wake-up of a delayed entry
        dispatch.after_commit(
            step.admissions,
            [*dropped, *superseded, *step.finished],
            step.wake,
            requeue=_requeue_unpublished,
        )
    # Admitted by this call's own pass or by its follow-up pass (as on the fast path).
    admissions = [*step.admissions, *_follow_up(_still_needed(step, pools))]
    if elsewhere is not None:  # older entries of the job in other pools (a changed demand)
        end_waiting_of_job(sub.job, **elsewhere)
    return Enqueued(
        entry_id=entry.queue_id,
        key=entry.key,
        admitted=any(a.entry_id == entry.queue_id for a in admissions),
    )


def _create_entry(sub: Submission, now: datetime, deadline: datetime | None) -> QueueEntry:
    """The entry row of a submit (its line rows are :func:`_demand_rows`)."""
    return QueueEntry.objects.create(
        key=sub.key,
        task_name=sub.task_name,
        args=_shown(sub.args),
        kwargs=_shown(sub.kwargs),
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
    )


def _demand_rows(
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


def _supersede_on_enqueue(
    sub: Submission, entry: QueueEntry, pools: dict[str, Pool], now: datetime
) -> tuple[list[Finished], dict[str, Any] | None]:
    """End the waiting entries of the new entry's job that it supersedes.

    ``replace``: every older waiting entry of the job. A scheduled fire (beat, first
    attempt): the job's queued retries. Those in the locked pools end in this transaction;
    returns them, and the arguments of :func:`end_waiting_of_job` for any others. See
    docs/howto/job-policies.md.
    """
    if not sub.job:
        return [], None
    if sub.concurrency_policy == ConcurrencyPolicy.REPLACE:
        reason, retries_only = f"replaced by a newer entry of job {sub.job} ({sub.key})", False
    elif sub.origin == Origin.BEAT and not sub.attempt:
        reason, retries_only = f"superseded by a newer fire of job {sub.job} ({sub.key})", True
    else:
        return [], None
    older = _waiting_of_job(sub.job, retries_only=retries_only).exclude(pk=entry.pk)
    mine, others = [], False
    for row in older[:JOB_BATCH]:
        if set(row.demand) <= pools.keys():
            mine.append(row)
        else:
            others = True
    finished = _finish_waiting(mine, EntryState.SUPERSEDED, now, reason=reason) if mine else []
    rest = {"state": EntryState.SUPERSEDED, "reason": reason, "retries_only": retries_only}
    return finished, ({**rest, "exclude": entry.pk} if others else None)


def _waiting_of_job(job: str, *, retries_only: bool = False) -> Any:
    """Waiting entries of ``job`` (index ``pools_entry_job``), oldest first."""
    rows = QueueEntry.objects.filter(
        job=job, finished_at__isnull=True, state=EntryState.WAITING
    ).order_by("queue_id")
    return rows.filter(attempt__gt=0) if retries_only else rows


def end_waiting_of_job(
    job: str,
    *,
    state: EntryState,
    reason: str,
    retries_only: bool = False,
    origins: Sequence[str] = (),
    exclude: int | None = None,
    ids: Sequence[int] | None = None,
) -> int:
    """End the waiting entries of ``job`` (``superseded`` or ``cancelled``) with ``reason``.

    Used when a job's retries are superseded (a success, a cancellation) and when its
    periodic task changes (``origins``: only entries from beat fires and manual starts;
    ``ids``: only these entries).
    Each group of pools is locked in turn; their results become revocations after commit.
    Returns how many entries ended.
    """
    if not job:
        return 0
    rows = _waiting_of_job(job, retries_only=retries_only)
    if origins:
        rows = rows.filter(origin__in=list(origins))
    if exclude is not None:
        rows = rows.exclude(pk=exclude)
    if ids is not None:
        rows = rows.filter(pk__in=list(ids))
    with unavailable_on_error(f"ending waiting entries of job {job}"):
        found = list(rows.values_list("queue_id", "demand")[:JOB_BATCH])
    groups: dict[tuple[str, ...], list[int]] = {}
    for queue_id, demand in found:
        groups.setdefault(tuple(sorted(demand)), []).append(queue_id)
    count = 0
    for names, ids in groups.items():
        with locked_pools(names) as pools:
            entries = list(QueueEntry.objects.filter(pk__in=ids, state=EntryState.WAITING))
            finished = _finish_waiting(entries, state, timezone.now(), reason=reason[:255])
            needs = _admit_in(pools, timezone.now(), finished)
        _follow_up(needs)
        count += len(entries)
    return count


def supersede_retries(job: str, *, reason: str) -> int:
    """A success or a cancellation of ``job``: its queued retries end ``superseded``."""
    return end_waiting_of_job(job, state=EntryState.SUPERSEDED, reason=reason, retries_only=True)


def _refuse(
    demand: dict[str, int], pools: dict[str, Pool], now: datetime, *, drop: bool = True
) -> list[Finished]:
    """Raise the refusal that wins (docs/concepts/contract.md), if any; under the locks.

    Precedence: an unknown pool, then a demand above a pool's capacity, then a pool paused
    with ``paused_policy="reject"``, then a draining pool, then a full backlog whose
    overflow policy is ``reject``; within each, the first pool by name.
    The enqueue function of the fast path does the same, and hands the policies to this function.
    A full backlog with ``drop_oldest`` / ``drop_newest`` drops one waiting entry
    instead (returned, already ended ``rejected``); with ``drop=False`` (no locks held) it
    raises :class:`_NeedsLocks` instead.
    """
    names = sorted(demand)
    for name in names:
        if name not in pools:
            raise UnknownPool(name)
    for name in names:
        if demand[name] > pools[name].slots:
            raise DemandExceedsCapacity(name, demand[name], pools[name].slots)
    for name in names:
        if pools[name].paused and pools[name].paused_policy == PausedPolicy.REJECT:
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
                raise _NeedsLocks(name)
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
            for f in _finish_waiting([victim], EntryState.REJECTED, now, reason=reason)
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


def _shown(value: Any) -> Any:
    """Arguments as stored for display: a repr string as it is, else list/dict data."""
    if isinstance(value, str):
        return value.replace("\x00", "\\x00")  # PostgreSQL text holds no NUL character
    return dict(value) if isinstance(value, dict) else list(value)


def _deadline(sub: Submission, now: datetime) -> datetime | None:
    """The earlier of the ``queue_timeout`` deadline (counted from when the entry is due)
    and Celery's ``expires``."""
    deadline = None
    if sub.spec.queue_timeout is not None:
        deadline = max(now, sub.not_before or now) + timedelta(seconds=sub.spec.queue_timeout)
    if sub.expires is not None and (deadline is None or sub.expires < deadline):
        deadline = sub.expires
    return deadline


def _enqueue_in_one_call(
    sub: Submission, now: datetime, deadline: datetime | None
) -> Enqueued | None:
    """:func:`enqueue` as one call of the enqueue function (PostgreSQL fast path).

    ``None`` when a pool policy decides the enqueue (the function wrote nothing): the
    caller then runs the Python path.
    """
    spec = sub.spec
    reply = fastpath.call(
        functions.name("enqueue"),
        [
            sub.key,
            sub.task_name,
            fastpath.jsonb(_shown(sub.args)),
            fastpath.jsonb(_shown(sub.kwargs)),
            fastpath.jsonb(sub.options),
            fastpath.jsonb(dict(spec.demand)),
            spec.priority,
            now,
            sub.not_before,
            deadline,
            sub.origin,
            sub.root_id or "",
            sub.parent_id or "",
            sub.attempt,
            conf.get().LEASE_SECONDS,
            fastpath.listening(),
            sub.fairness_key,
        ],
        what=f"pools {', '.join(sorted(spec.demand))}",
    )
    refused = reply.first("refused")
    if refused is not None:
        pool = refused.pool or ""
        if refused.reason == "unknown":
            raise UnknownPool(pool)
        if refused.reason == "capacity":
            raise DemandExceedsCapacity(pool, refused.asked or 0, refused.limit or 0)
        if refused.reason == "policy":
            return None
        raise PoolFull(pool, refused.limit or 0)
    enqueued = reply.first("enqueued")
    if enqueued is None or enqueued.entry is None:  # pragma: no cover - function contract
        raise RuntimeError(f"{functions.name('enqueue')} returned neither refused nor enqueued")
    admissions = _on_commit(reply)
    admissions += _follow_up(reply.fallbacks)
    return Enqueued(
        entry_id=enqueued.entry,
        key=sub.key,
        admitted=any(a.entry_id == enqueued.entry for a in admissions),
    )


def _on_commit(reply: fastpath.Reply) -> list[Admission]:
    """Hand a fast-path call's admissions, wake-ups and events to the after-commit hooks."""
    admissions = [
        Admission(
            entry_id=row.entry or 0,
            key=row.key or "",
            token=row.token or 0,
            task_name=row.task or "",
            args=row.args,
            kwargs=row.kwargs,
            options=row.options,
        )
        for row in reply.of("admitted")
    ]
    # Publishing first: a signal receiver that raises must not keep a message from the broker.
    dispatch.after_commit(
        admissions, [], reply.wake, committed=reply.committed, requeue=_requeue_unpublished
    )
    events.announce(reply.events, committed=reply.committed)
    return admissions


def _line_reaches(pool: Pool, count: int) -> bool:
    """True if the pool has at least ``count`` waiting entries (reads at most ``count`` rows)."""
    if count <= 0:
        return True
    return Demand.objects.queued().filter(pool_id=pool.pk).order_by()[count - 1 : count].exists()


def settle(
    entry_id: int, token: int, outcome: str, *, reason: str = "", live_lease: bool = False
) -> bool:
    """Finish a held attempt (exactly once per token), then admit the next entries.

    Returns False, changing nothing, when the token is stale, the entry already settled,
    or (``live_lease=True``, used by workers) its lease has already lapsed.
    """
    if fastpath.enabled():
        return _settle_in_one_call(entry_id, token, outcome, reason, live_lease)
    with unavailable_on_error(f"settling entry {entry_id}"):
        entry = QueueEntry.objects.filter(pk=entry_id).only("demand", "job").first()
    if entry is None:
        return False
    now = timezone.now()
    with locked_pools(entry.demand) as pools:
        claim = QueueEntry.objects.filter(pk=entry_id, token=token, state__in=HELD_STATES)
        if live_lease:
            claim = claim.filter(lease_expires_at__gte=now)
        # cancel(terminate=True) marked it before the worker stopped the body: the attempt
        # ends as a cancellation whatever state Celery gave it. Read under the lock.
        terminating = When(reason=TERMINATING, then=Value(EntryState.CANCELLED.value))
        changed = claim.update(
            state=Case(terminating, default=Value(outcome)),
            reason=Case(When(reason=TERMINATING, then=Value("revoked")), default=Value(reason)),
            finished_at=now,
            lease_expires_at=None,
        )
        if changed:
            entry.refresh_from_db(fields=["key", "token", "demand", "state", "admitted_at"])
            spendcap.add_spend(pools, entry, now)
            Demand.objects.filter(entry_id=entry_id).update(state=entry.state)
            _change_held(pools, [entry], -1)
            events.transition(EventKind.SETTLED, [entry], at=now, detail={"outcome": entry.state})
            needs = _admit_in(pools, now)
    if changed:
        _follow_up(needs | _forbid_waiters(entry.job, pools))
    return bool(changed)


def _forbid_waiters(job: str, locked: Iterable[str]) -> set[str]:
    """Pools (beyond ``locked``) of ``forbid`` instances of ``job`` that wait: an instance
    of the job just finished, so they may be eligible now. Empty without a job.

    Read after the settle committed: a failure asks for a pass over ``locked`` later (which
    reaches the job's waiting instances through the sweep) instead of failing the settle.
    """
    if not job:
        return set()
    names: set[str] = set()
    waiting = QueueEntry.objects.waiting().filter(
        job=job, finished_at__isnull=True, concurrency_policy=ConcurrencyPolicy.FORBID
    )
    try:
        for demand in waiting.values_list("demand", flat=True)[:100]:
            names |= set(demand)
    except Exception as exc:
        _admit_later(locked, exc)
    return names - set(locked)


def _settle_in_one_call(
    entry_id: int, token: int, outcome: str, reason: str, live_lease: bool
) -> bool:
    """:func:`settle` as one call of the settle function (PostgreSQL fast path)."""
    reply = fastpath.call(
        functions.name("settle"),
        [
            entry_id,
            token,
            outcome,
            reason,
            live_lease,
            timezone.now(),
            conf.get().LEASE_SECONDS,
            fastpath.listening(),
        ],
        what=f"settling entry {entry_id}",
    )
    settled = reply.first("settled")
    if settled is None:
        return False
    _on_commit(reply)
    job = (settled.detail or {}).get("job", "")
    # As settle() on the ORM path: one pass over the pools the function left to Python
    # (the pass settle() runs under its locks), then one follow-up over the pools that
    # pass needs and those of waiting 'forbid' instances of the job. Merging the two
    # would run the first pass with more pools locked (a due multi-pool entry could then
    # join a line that the ORM path's first pass admits from without it).
    try:
        needs = _pass_over(reply.fallbacks, settled=entry_id)
    except Exception as exc:  # the settle has committed: it stands (see _follow_up)
        _admit_later(reply.fallbacks, exc)
        needs = set()
    _follow_up(needs | _forbid_waiters(job, settled.demand or {}))
    return True


def _pass_over(names: set[str], *, settled: int) -> set[str]:
    """One admission pass over ``names`` in its own transaction; returns the pools a
    follow-up pass must cover (what :func:`_admit_in` returns).

    Pools with a spend cap are among ``names`` (the function leaves them to Python): the
    attempt just settled (entry ``settled``) adds its slot-seconds to them first, under
    the same locks, so the pass decides with the day's spend.
    """
    if not names:
        return set()
    with locked_pools(names) as pools:
        if any(p.spend_cap is not None for p in pools.values()):
            entry = QueueEntry.objects.only("demand", "admitted_at", "finished_at").get(pk=settled)
            spendcap.add_spend(pools, entry, entry.finished_at or timezone.now())
        return _admit_in(pools, timezone.now())


def requeue(
    entry_id: int,
    token: int,
    *,
    reason: str,
    admit: bool = True,
    lapsed_before: datetime | None = None,
    unstarted: bool = False,
) -> bool:
    """Put a held entry back in line (same place), or expire it if its deadline passed.

    Used when a lease lapses or is lost, and when a publish fails; then ``admit=False``
    leaves re-admission to the next settle or sweep, so a broker outage cannot turn
    into a publish loop. ``unstarted=True`` (a message that may not have reached a worker)
    leaves an entry a worker has already started alone. Returns False for a stale token.
    """
    with unavailable_on_error(f"requeueing entry {entry_id}"):
        entry = QueueEntry.objects.filter(pk=entry_id).only("demand").first()
    if entry is None:
        return False
    now = timezone.now()
    with locked_pools(entry.demand) as pools:
        states = [EntryState.ADMITTED] if unstarted else HELD_STATES
        claim = QueueEntry.objects.filter(pk=entry_id, token=token, state__in=states)
        if lapsed_before is not None:  # re-checked under the lock: a start may have renewed it
            claim = claim.filter(lease_expires_at__lt=lapsed_before)
        # Compare-and-set: leases.start/renew do not take the pool lock.
        if not claim.update(
            state=EntryState.WAITING, lease_expires_at=None, worker="", reason=reason
        ):
            return False
        entry = QueueEntry.objects.get(pk=entry_id)
        Demand.objects.filter(entry_id=entry_id).update(state=EntryState.WAITING)
        _change_held(pools, [entry], -1)
        events.record(EventKind.REQUEUED, [entry], at=now, detail={"reason": reason})
        stop = budgets.rejects_requeue(entry)
        if stop is not None:  # its run has spent a budget: it does not wait again
            finished = [
                replace(f, budget=stop)
                for f in _finish_waiting([entry], EntryState.REJECTED, now, reason=BUDGET)
            ]
            needs = _admit_in(pools, now, finished)
        # The pass expires it if its deadline is gone, or admits it again.
        elif admit:
            needs = _admit_in(pools, now)
        else:
            needs = set()
    _follow_up(needs)
    return True


#: For :mod:`pools.core.budgets`, which ends a stopped run's waiting entries under its locks.
finish_waiting = _finish_waiting
admit_in = _admit_in
follow_up = _follow_up


def cancel(
    key: str, *, reason: str = "cancelled", terminate: bool = False, actor: str | None = None
) -> QueueEntry:
    """Cancel the entry with ``key``: a waiting one now (its result becomes a revocation).

    ``actor`` (a username, from the admin or the REST API) is logged with the event.

    With ``terminate=True`` an admitted or running entry is revoked in Celery
    (``revoke(terminate=True)``); its slots are freed once the worker has stopped it.
    Raises :class:`EntryNotFound` for an unknown key and :class:`NotCancellable`
    when the entry is finished, or running and ``terminate`` is false.
    """
    with unavailable_on_error(f"cancelling entry {key!r}"):
        entry = QueueEntry.objects.filter(key=key).order_by("-queue_id").first()
    if entry is None:
        raise EntryNotFound(key)
    now = timezone.now()
    needs: set[str] = set()
    with locked_pools(entry.demand) as pools:
        entry.refresh_from_db()
        if entry.state in HELD_STATES and terminate:
            QueueEntry.objects.filter(pk=entry.pk).update(reason=TERMINATING)
            events.record(
                EventKind.TERMINATE, [entry], at=now, detail={"reason": reason}, actor=actor
            )
            transaction.on_commit(lambda: dispatch.bridge().terminate(key))
        else:
            if entry.state != EntryState.WAITING:
                pool = next(iter(entry.demand))
                if entry.state in HELD_STATES:
                    why = "is already running; pass terminate=True to stop it"
                else:
                    why = f"is already {entry.state}"
                raise NotCancellable(
                    f"Entry {key!r} in pool {pool!r} {why}; only waiting entries can be cancelled."
                )
            finished = _finish_waiting(
                [entry], EntryState.CANCELLED, now, reason=reason, actor=actor
            )
            needs = _admit_in(pools, now, finished)
    _follow_up(needs)
    # A cancellation of the job supersedes its queued retries (docs/howto/job-policies.md).
    if entry.job:
        supersede_retries(entry.job, reason=f"job {entry.job} was cancelled ({key})")
    entry.refresh_from_db()
    return entry


def expire_due(now: datetime, *, limit: int = 500) -> int:
    """Expire waiting entries whose deadline has passed (sweep); returns how many."""
    rows = list(
        QueueEntry.objects.waiting()
        # past its deadline: deadline <= now, as in the pass (unfinished: the index's rows)
        .filter(deadline__lte=now, finished_at__isnull=True)
        .order_by("deadline")
        .values_list("queue_id", "demand")[:limit]
    )
    return _end_waiting(rows, now, _expire)


def cancel_waiting(entry_ids: Sequence[int], *, reason: str, actor: str | None = None) -> int:
    """Cancel those of ``entry_ids`` still waiting (each result becomes a revocation).

    Returns how many were cancelled; an entry admitted meanwhile is left alone. Used by
    ``app.control.purge()`` (:mod:`pools.celery.purge`).
    """
    now = timezone.now()
    cancelled = 0
    for start in range(0, len(entry_ids), 500):
        with unavailable_on_error("cancelling waiting entries"):
            rows = list(
                QueueEntry.objects.waiting()
                .filter(pk__in=entry_ids[start : start + 500])
                .values_list("queue_id", "demand")
            )
        cancelled += _end_waiting(
            rows,
            now,
            lambda entries, at: _finish_waiting(
                entries, EntryState.CANCELLED, at, reason=reason, actor=actor
            ),
        )
    return cancelled


def _end_waiting(
    rows: Iterable[tuple[int, dict[str, int]]],
    now: datetime,
    finish: Callable[[list[QueueEntry], datetime], list[Finished]],
) -> int:
    """End the waiting entries of ``rows`` (id, demand) with ``finish``, pools' locks held.

    One transaction per set of pools; the freed places are admitted at once.
    """
    groups: dict[tuple[str, ...], list[int]] = {}
    for queue_id, demand in rows:
        groups.setdefault(tuple(sorted(demand)), []).append(queue_id)
    count = 0
    for names, ids in groups.items():
        with locked_pools(names) as pools:
            entries = list(QueueEntry.objects.filter(pk__in=ids, state=EntryState.WAITING))
            finished = finish(entries, now)
            needs = _admit_in(pools, now, finished)
        _follow_up(needs)
        count += len(entries)
    return count


def cancel_if_waiting(key: str, *, reason: str) -> bool:
    """Cancel ``key`` if it is waiting; False (no error) otherwise. Used by ``revoke()``."""
    if not QueueEntry.objects.waiting().filter(key=key).exists():
        return False
    try:
        cancel(key, reason=reason)
    except (EntryNotFound, NotCancellable):
        return False
    return True


# --------------------------------------------------------------------------- inside a caller's transaction
#
# An enqueue inside the caller's ``atomic()`` (every view under ``ATOMIC_REQUESTS``) would
# hold the pool row lock until the caller commits, and every other enqueue, settle and
# admission pass of the pool would wait for it. Instead it writes its entry and line rows
# without the lock, out of line (``delayed``, due at the time of the call), and admission
# runs after the caller commits. Refusals are decided at the call without locks, from the
# committed state (docs/concepts/admission.md#calls-inside-a-transaction).


class _NeedsLocks(Exception):
    """A full pool would drop one of its entries (overflow policy): only under its lock."""


def _in_callers_transaction() -> bool:
    """True inside an ``atomic()`` block of the caller on PostgreSQL or MariaDB/MySQL.

    Not inside the blocks Django's ``TestCase`` wraps each test in (they never commit).
    On SQLite an ``IMMEDIATE`` transaction holds the database's write lock from its start:
    there the enqueue keeps the locked path.
    """
    if connection.vendor not in ("postgresql", "mysql") or not connection.in_atomic_block:
        return False
    return any(not getattr(block, "_from_testcase", False) for block in connection.atomic_blocks)


def _supersedes(sub: Submission) -> bool:
    """The submit ends older waiting entries of its job (``replace``, a beat fire)."""
    if not sub.job:
        return False
    return sub.concurrency_policy == ConcurrencyPolicy.REPLACE or (
        sub.origin == Origin.BEAT and not sub.attempt
    )


def _enqueue_in_callers_transaction(
    sub: Submission, now: datetime, deadline: datetime | None
) -> Enqueued | None:
    """:func:`enqueue` inside the caller's transaction, without pool locks.

    The refusals are checked against the pools' committed rows (no lock); the entry and
    its line rows are written in the caller's transaction, ``delayed`` until the time of
    the call, so no other process sees them before the caller commits and nothing is left
    if it rolls back. No pool row is locked before the commit: PostgreSQL checks the line
    rows' foreign keys when the caller commits, and on MariaDB/MySQL they are not checked
    at the insert (:func:`_insert_line_rows`). After the commit
    :func:`_admit_after_commit` puts the entry in line and runs admission.

    ``None`` (nothing written) when the submit needs the locks: it ends other entries (a
    ``replace`` job, a beat fire, a full pool's overflow drop); the caller then takes the
    locked path.
    """
    spec = sub.spec
    if _supersedes(sub):
        return None
    names = sorted(spec.demand)
    with unavailable_on_error(f"pools {', '.join(names)}"), transaction.atomic():
        pools = {p.name: p for p in Pool.objects.filter(name__in=names)}
        try:
            _refuse(spec.demand, pools, now, drop=False)
        except _NeedsLocks:
            return None
        if sub.attempt and sub.idempotency_key is not None:
            QueueEntry.objects.filter(
                key=sub.key, idempotency_key=sub.idempotency_key, state__in=HELD_STATES
            ).update(idempotency_key=None)
        entry = _create_entry(sub, now, deadline)
        joins = sub.not_before if sub.not_before and sub.not_before > now else now
        _insert_line_rows(_demand_rows(sub, entry, pools, joins, delayed=True))
        events.transition(EventKind.ENQUEUED, [entry], at=now)
    # robust: an unexpected error is logged, never raised out of the caller's commit.
    transaction.on_commit(lambda: _admit_after_commit(names, joins), robust=True)
    return Enqueued(entry_id=entry.queue_id, key=entry.key, admitted=False)


def _insert_line_rows(rows: list[Demand]) -> None:
    """Insert an entry's line rows in the caller's transaction without locking their pools.

    On MariaDB/MySQL a checked foreign key would hold a shared lock on each pool row until
    the caller commits (:func:`~pools.core.locking.parent_rows_unlocked`); the pools are
    read again after the insert instead (READ COMMITTED: the latest committed rows), and a
    pool deleted meanwhile is refused as unknown. From then on the uncommitted rows keep
    the pool from being deleted, as a checked key would.
    """
    with parent_rows_unlocked():
        Demand.objects.bulk_create(rows)
    if connection.vendor == "mysql":
        ids = {row.pool_id: row.pool.name for row in rows}
        found = set(Pool.objects.filter(pk__in=list(ids)).values_list("pk", flat=True))
        missing = sorted(name for pk, name in ids.items() if pk not in found)
        if missing:
            raise UnknownPool(missing[0])


def _admit_after_commit(names: list[str], due: datetime) -> None:
    """After the caller committed: the entry is due at ``due``; admission runs now.

    Two short transactions: the pools' ``next_due_at`` is brought forward under their
    locks, then an ordinary admission pass (:func:`admit`) puts the entry in line and
    admits what fits. Never raises into the caller's commit: if the pools cannot be
    locked now, the sweep's :func:`note_due_entries` finds the entry and admits it.
    """
    try:
        with locked_pools(names) as pools:
            _note_due(pools, [n for n in names if n in pools], due)
        admit(names)
    except PoolUnavailable as exc:
        logger.warning(
            "Admission after commit of an entry of pools %s deferred to the sweep: %s",
            ", ".join(names),
            exc,
        )


def note_due_entries() -> int:
    """Pools with delayed line rows due before their ``next_due_at`` get it corrected.

    Admission looks at a pool's delayed rows only from its ``next_due_at``, which an
    enqueue inside a caller's transaction sets after the commit: a process that died
    between its commit and that moment leaves rows no pass would look at. The sweep
    calls this: one query, an index probe per pool (``pools_demand_delayed``), and a lock
    only for a pool that needs it. Returns how many pools were corrected.
    """
    delayed = Demand.objects.delayed().filter(pool_id=OuterRef("pk"))
    suspects = list(
        Pool.objects.filter(
            Q(Exists(delayed), next_due_at__isnull=True)
            | Q(Exists(delayed.filter(enqueued_at__lt=OuterRef("next_due_at"))))
        ).values_list("name", flat=True)
    )
    for name in suspects:
        with locked_pools([name]) as pools:
            if name in pools:
                first = (
                    Demand.objects.delayed()
                    .filter(pool_id=pools[name].pk)
                    .order_by("enqueued_at")
                    .values_list("enqueued_at", flat=True)
                    .first()
                )
                if first is not None:
                    _note_due(pools, [name], first)
    return len(suspects)
