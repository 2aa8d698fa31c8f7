"""The admission pass: admit every entry that fits, in line order, in pools the caller locked.

See ``docs/concepts/contract.md`` (admit) and ``docs/concepts/admission.md``. Running a
pass in its own transaction, and the follow-up passes, are :mod:`pools.core.pass_runs`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db.models import Case, F, Value, When

from pools import conf
from pools.core import backoff_ends, eligibility, events, nodes, spendcap, strategies, windows
from pools.core.ending import expire_entries
from pools.core.held import apply_owed, change_held, held_by_pool
from pools.core.records import Admission, Finished
from pools.models import Demand, Pool, QueueEntry
from pools.pool_names import NAMED_RANK, gate_rank
from pools.states import DELAYED, EntryState, EventKind

#: At most this many line rows are read per pool per round of an admission pass.
LINE_BATCH = 200
#: At most this many entries held back by a workflow cap are skipped per named pool
#: and pass (they are not in the named pools' lines until their caps have room; see
#: docs/howto/workflow-caps.md). Beyond it the pool waits, as behind any head.
CAP_SKIP = 100
#: At most this many delayed entries join the line per admission pass (the rest next pass).
PROMOTE_BATCH = 500


@dataclass(kw_only=True)
class PassResult:
    """What one admission pass did, and what it leaves to a wake-up or a follow-up pass."""

    admissions: list[Admission] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)
    #: Pools named by a blocked multi-pool head that this pass had not locked.
    needs: set[str] = field(default_factory=set)
    #: Pools whose head waits for its ``not_before``: when to run admission again.
    wake: dict[str, datetime] = field(default_factory=dict)


def admit_locked(pools: dict[str, Pool], now: datetime) -> PassResult:
    """Admit every entry that fits, in line order, in the pools locked by the caller."""
    result = PassResult()
    by_id = {p.pk: p for p in pools.values()}
    # Releases (and passes) owed by calls that found these pools locked (PostgreSQL): taken
    # first, so this pass admits with those slots free.
    apply_owed(by_id.values())
    held = held_by_pool(by_id)
    free = {pid: p.slots - held.get(pid, 0) for pid, p in by_id.items()}
    lease = timedelta(seconds=conf.get().LEASE_SECONDS)
    _promote_due(pools, now, result)
    backoff_ends.end_due_locked(pools.values(), now)
    for pool in pools.values():
        if pool.backoff_until is not None:  # still in backoff: look again when it ends
            result.wake[pool.name] = min(
                result.wake.get(pool.name, pool.backoff_until), pool.backoff_until
            )
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
    skipped: set[int] = set()
    skips: dict[int, int] = {}
    # Rate limits (pools.core.rates): checked with the slots, in line order.
    rated = windows.Windows(pools)
    caps = _CapRoom(pools, free, rated)

    while True:
        lines: dict[int, deque[Demand]] = {}
        full_batch: set[int] = set()
        for pid, pool in by_id.items():
            if pool.paused or free[pid] <= 0 or pool.name in capped:
                continue
            limit = min(free[pid] + (CAP_SKIP if pid in skips else 0), LINE_BATCH)
            if pool.name in rated.rates:  # no more rows than its rates can admit now
                limit = min(limit, rated.room(pool.name))
            query = Demand.objects.line(pid).select_related("entry")
            if done or skipped:  # rows handled earlier in this pass are not written back yet
                query = query.exclude(entry_id__in=done | skipped)
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
                    and skips.get(pool.pk, 0) < CAP_SKIP
                    and caps.holds_back(entry)
                ):
                    # Not through its cap yet: not in this pool's line (ordered gates).
                    skips[pool.pk] = skips.get(pool.pk, 0) + 1
                    skipped.add(entry.queue_id)
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
                rated=any(name in rated.rates for name in e.demand),
            )
            for e in admitted
        )
    if expired:
        result.finished.extend(expire_entries(expired, now))
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


def _promote_due(pools: dict[str, Pool], now: datetime, result: PassResult) -> None:
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


def note_due(pools: dict[str, Pool], names: Iterable[str], when: datetime) -> None:
    """A delayed entry was put in these pools: bring their ``next_due_at`` forward."""
    for name in names:
        pool = pools[name]
        if pool.next_due_at is None or when < pool.next_due_at:
            pool.next_due_at = when
            Pool.objects.filter(pk=pool.pk).update(next_due_at=when)


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
    seq = change_held(pools, entries, +1, admitted=True)
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
