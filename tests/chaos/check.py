"""The chaos checker: pure functions over the bodies' own records.

Method. A body is counted alive from its ``start`` line to its **last sign of life**: the
last line it wrote (its ``end``, or the last ``tick`` a long body writes every 0.1 s; a
SIGKILLed body writes no ``end``, its last tick is the last moment it is known to have
run). Not to the end of its lease: a body that outlives its lease (a keeper that failed to
fence it) is still counted, and two such bodies of one slot are a violation.

One exception, a limit nothing in a process can lift: a body **paused** (SIGSTOP) cannot
fence itself while frozen. When it resumes after its lease lapsed it runs for a moment
until its keeper's watchdog (frozen too) sees the fence time passed and interrupts it. A paused body is counted, as
before, until the earlier of its last sign of life and ``valid_until`` (the end of its lease
as its own process last renewed it): from then on its entry is back in line and the fencing
token keeps its late writes out. The runner says which bodies were paused.

Lost wake-ups (:func:`starved_heads`), from the database's own record of every transition
(:func:`pools.core.events.stream`: the entries' times and the event log), not the bodies'.
It counts the moments when a **due head** of a pool's line waited more than 100 ms while
the slots it asks for were free: an entry in line (enqueued or requeued, not yet admitted;
a delayed one from its ``not_before``), surely first in the line of every pool it asks for
by ``(-priority, enqueued_at)``, and for each of them ``capacity - held >= `` its demand,
where a slot is held from the entry's admission to its settle or requeue (a killed worker's
entry holds its slots until the sweep requeues it: not a lost wake-up). An entry requeued
carries only its last admission: before each earlier requeue its admission time is
unknown, so from its previous enqueue or requeue it counts as holding its slots and as
possibly (never surely) in line. The windows when the runner knew PostgreSQL was down
(restarts, partitions) and :data:`DOWN_GRACE` seconds after are not counted, nor are
entries of pools that were paused, backed off or had a rate during the run (their heads
wait for the rate's window or the backoff's end, which this count does not model). An
entry's own transitions are read in token order where their stamps disagree
(:func:`stamp_skews`: a re-admission stamped before the requeue it followed). See
:mod:`tests.support.starvation` for the walk.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.support import starvation

if TYPE_CHECKING:
    from pools.models import PoolEvent, QueueEntry

#: After PostgreSQL is back, workers reconnect and the sweep runs: not counted either.
DOWN_GRACE = 5.0


@dataclass(frozen=True)
class Body:
    """One run of a task body, as it recorded itself."""

    key: str
    entry: int
    token: int
    demand: dict[str, int]
    start: float
    end: float | None
    valid_until: float
    pid: int
    #: Time of the last line it wrote (start, tick or end); None in hand-made records.
    last: float | None = None
    #: Paused (SIGSTOP) while it ran: counted until its lease ended (see the module doc).
    paused: bool = False
    #: How long the body meant to run (milliseconds), from its start line.
    millis: int | None = None
    #: The task type (``single_a``, ``typed_b``...).
    task: str = ""

    @property
    def holds_until(self) -> float:
        """End of the interval during which this body is counted alive."""
        if self.paused or self.last is None:
            return self.valid_until if self.end is None else min(self.end, self.valid_until)
        return self.last


@dataclass
class Violations:
    """What the checker found; empty lists mean the promises held."""

    oversubscribed: list[str] = field(default_factory=list)
    same_claim_twice: list[str] = field(default_factory=list)
    same_entry_twice: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.oversubscribed or self.same_claim_twice or self.same_entry_twice)

    def lines(self) -> list[str]:
        return self.oversubscribed + self.same_claim_twice + self.same_entry_twice


def read_bodies(
    where: Path, pauses: Mapping[int, Iterable[tuple[float, float]]] | None = None
) -> list[Body]:
    """The bodies recorded in ``where/bodies-*.jsonl`` (``start``, ``tick`` and ``end`` lines).

    ``pauses``: per pid, the ``(stopped, resumed)`` times of its SIGSTOPs; a body that was
    running (between its start and its last sign of life) during one is marked ``paused``.
    """
    starts: dict[tuple[int, int, int], dict[str, Any]] = {}
    ends: dict[tuple[int, int, int], dict[str, Any]] = {}
    last: dict[tuple[int, int, int], float] = {}
    for path in sorted(where.glob("bodies-*.jsonl")):
        for raw in path.read_text().splitlines():
            if not raw.strip():
                continue
            line = json.loads(raw)
            ident = (line["entry"], line["token"], line["pid"])
            last[ident] = max(last.get(ident, line["t"]), line["t"])
            if line["kind"] == "start":
                starts[ident] = line
            elif line["kind"] == "end":
                ends[ident] = line
    bodies = []
    for ident, s in starts.items():
        e = ends.get(ident)
        seen = last[ident]
        windows = (pauses or {}).get(s["pid"], ())
        bodies.append(
            Body(
                key=s["key"],
                entry=s["entry"],
                token=s["token"],
                demand={k: int(v) for k, v in s["demand"].items()},
                start=s["t"],
                end=e["t"] if e else None,
                valid_until=e["valid_until"] if e else s["valid_until"],
                pid=s["pid"],
                last=seen,
                paused=any(stop < seen and s["t"] < resume for stop, resume in windows),
                millis=s.get("millis"),
                task=s.get("task", ""),
            )
        )
    return sorted(bodies, key=lambda b: b.start)


def max_overlap(bodies: Iterable[Body]) -> dict[str, tuple[int, float]]:
    """Per pool: the most slots held at once by bodies with a valid lease, and when."""
    events: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for body in bodies:
        if body.holds_until <= body.start:
            continue
        for pool, slots in body.demand.items():
            events[pool].append((body.start, slots))
            events[pool].append((body.holds_until, -slots))
    peaks: dict[str, tuple[int, float]] = {}
    for pool, items in events.items():
        held, peak, when = 0, 0, 0.0
        # At the same instant a release counts before an acquisition.
        for t, delta in sorted(items, key=lambda x: (x[0], x[1])):
            held += delta
            if held > peak:
                peak, when = held, t
        peaks[pool] = (peak, when)
    return peaks


def _overlapping(group: list[Body]) -> list[tuple[Body, Body]]:
    pairs = []
    ordered = sorted(group, key=lambda b: b.start)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if b.start >= a.holds_until:
                break
            if b.start < a.holds_until and a.start < b.holds_until:
                pairs.append((a, b))
    return pairs


def check(bodies: list[Body], capacity: dict[str, int]) -> Violations:
    """Never oversubscribe; never run one claim twice at once; one entry, one holder."""
    found = Violations()
    for pool, (peak, when) in sorted(max_overlap(bodies).items()):
        if peak > capacity.get(pool, 0):
            found.oversubscribed.append(
                f"pool {pool}: {peak} slots held at once at t={when:.3f}, capacity {capacity.get(pool)}"
            )
    by_claim: dict[tuple[int, int], list[Body]] = defaultdict(list)
    by_entry: dict[int, list[Body]] = defaultdict(list)
    for body in bodies:
        by_claim[(body.entry, body.token)].append(body)
        by_entry[body.entry].append(body)
    for (entry, token), group in sorted(by_claim.items()):
        for a, b in _overlapping(group):
            found.same_claim_twice.append(
                f"entry {entry} token {token} ran twice at once (pids {a.pid}, {b.pid})"
            )
    for entry, group in sorted(by_entry.items()):
        for a, b in _overlapping(group):
            if a.token != b.token:
                found.same_entry_twice.append(
                    f"entry {entry} held by two bodies at once (tokens {a.token}, {b.token})"
                )
    return found


def typed_mismatches(
    expected: Mapping[str, Any], outcomes: Mapping[str, tuple[str, Any]], skip: Iterable[str] = ()
) -> list[str]:
    """Typed-argument calls whose outcome is not what plain Celery returns.

    ``expected``: key -> the result the call must return (its arguments, as sent);
    ``outcomes``: key -> (Celery state, result). A call in ``skip`` (cancelled) may end
    otherwise. Equality is Python's, and the type must match too: a date that came back as
    its ISO text, a naive datetime made aware or bytes made text are mismatches.
    """
    skipped = set(skip)
    found = []
    for key, want in sorted(expected.items()):
        if key in skipped:
            continue
        state, got = outcomes.get(key, ("MISSING", None))
        if state != "SUCCESS":
            found.append(f"typed call {key} ended {state}: {got!r}"[:300])
        elif not _same(got, want):
            found.append(f"typed call {key} returned {got!r}, sent {want!r}"[:300])
    return found


def _same(got: Any, want: Any) -> bool:
    """Equal and of the same types all the way down (1 == 1.0 and aware/naive differ)."""
    if type(got) is not type(want):
        return False
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want, strict=True))
    if isinstance(want, datetime):
        return bool(got == want and got.utcoffset() == want.utcoffset())
    return bool(got == want)


#: Entries a fault of each kind may legitimately send through admission again, per worker
#: process it hits: a SIGKILLed worker's running and reserved calls (prefetch 1, and an
#: admission in flight), a paused child's one body. Cancelling takes nothing out of a holder.
READMISSIONS_PER_FAULT = {"sigkill": 3, "sigstop": 2, "cancel_burst": 0}


def readmitted(bodies: Iterable[Body]) -> dict[str, set[int]]:
    """Per task type: the entries that ran under a later admission than their first.

    An entry's fencing token grows by one per admission, so a body that starts with a
    token above 1 belongs to an entry admitted again after its first admission lapsed or
    was requeued: its first message never ran (a fault took its holder, or it was never
    published).
    """
    found: dict[str, set[int]] = defaultdict(set)
    for body in bodies:
        if body.token > 1:
            found[body.task].add(body.entry)
    return dict(found)


def readmission_allowance(kinds: Iterable[str], concurrency: int) -> int | None:
    """How many re-admitted entries the faults explain; None when a server restart is among
    them (a broker restart loses every queued message: no useful bound)."""
    total = 0
    for kind in kinds:
        per = READMISSIONS_PER_FAULT.get(kind)
        if per is None:
            return None
        total += per * (concurrency if kind == "sigkill" else 1)
    return total


# ----------------------------------------------------------------------------- lost wake-ups


@dataclass(frozen=True)
class Transition:
    """One row of the database's stream of an entry (:func:`pools.core.events.stream`)."""

    #: Seconds since the epoch.
    at: float
    #: An ``EventKind`` value: enqueued, admitted, started, settled, requeued, cancelled...
    kind: str
    entry: int
    pool: str
    slots: int
    #: The claim's fencing token (0: unknown). A requeue carries the token it took back, an
    #: admission the token it granted.
    token: int = 0


@dataclass(frozen=True)
class Waiter:
    """What the stream does not carry about an entry: its place and when it was due."""

    priority: int = 0
    #: Seconds since the epoch, for an entry that was delayed.
    not_before: float | None = None


def recorded(
    entries: Iterable[QueueEntry], logged: Iterable[PoolEvent]
) -> tuple[list[Transition], dict[int, Waiter]]:
    """The database's record of ``entries`` as the checker reads it: their transitions
    (:func:`pools.core.events.stream`, with ``logged``: their rows of the event log) and
    what the stream does not carry (priority, due time)."""
    from pools.core import events

    entries = list(entries)
    stream = [
        Transition(
            e.at.timestamp(),
            e.kind,
            e.entry_id,
            e.pool,
            int(e.detail.get("slots", 0)),
            e.token or 0,
        )
        for e in events.stream(entries, logged)
        if e.entry_id is not None
    ]
    waiters = {
        e.queue_id: Waiter(e.priority, e.not_before.timestamp() if e.not_before else None)
        for e in entries
    }
    return stream, waiters


#: Kinds that end an entry's wait for good (logged rows).
ENDS_WAITING = frozenset({"expired", "cancelled", "rejected", "superseded", "dropped"})


def lines_and_holds(
    stream: Iterable[Transition], waiters: Mapping[int, Waiter]
) -> tuple[list[starvation.Stay], list[starvation.Hold]]:
    """Each entry's stays in line and its holds of slots, from the stream (see the module doc)."""
    stays: list[starvation.Stay] = []
    holds: list[starvation.Hold] = []
    for entry, rows in _by_entry(stream).items():
        s, h = _entry_life(entry, rows, waiters.get(entry, Waiter()))
        stays += s
        holds += h
    return stays, holds


def _by_entry(stream: Iterable[Transition]) -> dict[int, list[Transition]]:
    by_entry: dict[int, list[Transition]] = defaultdict(list)
    for t in stream:
        by_entry[t.entry].append(t)
    return by_entry


def _read(
    rows: Iterable[Transition],
) -> tuple[dict[str, int], dict[str, float], dict[float, int], bool]:
    """One entry's demand, the first time of each kind of transition, its requeues (time
    -> the token taken back), and whether its last admission was stamped before the
    requeue it followed (:func:`stamp_skews`): its time is then that requeue's, since a
    granted token above a requeue's came after it, whatever the stamps say."""
    demand: dict[str, int] = {}
    times: dict[str, float] = {}
    tokens: dict[str, int] = {}
    requeues: dict[float, int] = {}
    for t in rows:
        demand[t.pool] = t.slots
        if t.kind == "requeued":
            requeues[t.at] = max(t.token, requeues.get(t.at, 0))
        else:
            times[t.kind] = min(t.at, times.get(t.kind, t.at))
            tokens[t.kind] = t.token
    admitted = times.get("admitted")
    last = max(requeues, default=None)
    skewed = (
        admitted is not None
        and last is not None
        and admitted < last
        and 0 < requeues[last] < tokens.get("admitted", 0)
    )
    if skewed and last is not None:
        times["admitted"] = last
    return demand, times, requeues, skewed


def _entry_life(
    entry: int, rows: Iterable[Transition], info: Waiter
) -> tuple[list[starvation.Stay], list[starvation.Hold]]:
    demand, times, requeues, _ = _read(rows)
    if "enqueued" not in times:
        return [], []
    # Its place in line: (-priority, when it joined it: enqueued, or due if delayed).
    joins = max(times["enqueued"], info.not_before or times["enqueued"])
    base = starvation.Stay(entry, demand, info.priority, joins, joins, joins, joins)
    admitted = times.get("admitted")
    stays: list[starvation.Stay] = []
    holds: list[starvation.Hold] = []
    since = joins
    for requeued in sorted(requeues):
        # (A requeue that admits it again in its own pass stamps both with one time.)
        if admitted is not None and since <= admitted < requeued:
            stays.append(replace(base, possibly_from=since, surely_from=since, until=admitted))
            holds.append(starvation.Hold(demand, admitted, requeued))
        else:  # admitted at an unknown time: held (and possibly in line) all along
            unsure = replace(base, possibly_from=since, surely_from=starvation.FOREVER)
            stays.append(replace(unsure, until=requeued))
            holds.append(starvation.Hold(demand, since, requeued))
        since = requeued
    if admitted is not None and admitted >= since:
        stays.append(replace(base, possibly_from=since, surely_from=since, until=admitted))
        holds.append(starvation.Hold(demand, admitted, times.get("settled", starvation.FOREVER)))
    else:
        ended = min((times[k] for k in ENDS_WAITING if k in times), default=starvation.FOREVER)
        stays.append(replace(base, possibly_from=since, surely_from=since, until=ended))
    return stays, holds


def stamp_skews(stream: Iterable[Transition]) -> list[int]:
    """Entries whose last admission is stamped before the requeue it followed (by tokens).

    Every transition is stamped with its caller's clock read before it waited for the
    pools' locks (a stored function's ``p_now``, the Python pass's ``now``): an admission
    that waited behind the requeue it follows can carry the earlier time. The checker
    orders such an entry's own transitions by token (:func:`_read`); the runner prints
    how many there were.
    """
    return sorted(entry for entry, rows in _by_entry(stream).items() if _read(rows)[3])


def starved_heads(
    stream: Iterable[Transition],
    waiters: Mapping[int, Waiter],
    capacity: Mapping[str, int],
    *,
    down: Iterable[tuple[float, float]] = (),
    uncounted_pools: Iterable[str] = (),
    threshold: float = starvation.THRESHOLD,
    multi_pool_threshold: float | None = None,
) -> list[starvation.Episode]:
    """Lost wake-ups: due heads that waited over 100 ms with their slots free (an entry of
    several pools: over :data:`MULTI_POOL_THRESHOLD`). With ``threshold=0`` and
    ``multi_pool_threshold=0``: every such wait, however short (the margin, in the summary).

    ``down``: ``(from, to)`` windows when the database was down (:data:`DOWN_GRACE` is
    added after each); ``uncounted_pools``: pools whose entries are not counted (paused,
    backed off, rated).
    """
    stays, holds = lines_and_holds(stream, waiters)
    excluded = [(a, b + DOWN_GRACE) for a, b in down]
    skip = set(uncounted_pools)
    found = starvation.starved_heads(
        stays,
        holds,
        capacity,
        excluded=excluded,
        threshold=threshold,
        multi_pool_threshold=(
            MULTI_POOL_THRESHOLD if multi_pool_threshold is None else multi_pool_threshold
        ),
    )
    return [e for e in found if not skip & set(e.demand)]


@dataclass(frozen=True)
class Stall:
    """A process fault that can stop a process between a commit and its follow-up: a
    SIGKILLed worker (``worker``: its hostname) or a SIGSTOPped pool process (``pid``)."""

    at: float
    worker: str = ""
    pid: int = 0


#: How long after its release (its stamp) the releasing process may be stopped with its
#: follow-up pass still to run: the commit and the follow-up's start, under load.
FOLLOW_UP_WINDOW = 0.5


def lost_with_their_process(
    episodes: Iterable[starvation.Episode],
    stream: Iterable[Transition],
    releasers: Mapping[int, tuple[str, int]],
    stalls: Iterable[Stall],
    sweep: float,
) -> list[starvation.Episode]:
    """The episodes that began with a release whose process was then killed or stopped
    before its follow-up admission pass, and ended by the next sweep after the fault.

    A settle commits its release, then runs the pass the stored function left to Python
    (a multi-pool head's) after that commit: a process killed in between takes that pass
    with it, and the sweep (every ``sweep`` seconds) runs it. That is the engine's
    recovery, not a lost wake-up. ``releasers``: entry -> (the worker that ran it, the pid
    of its last body). An episode counts as such when the last release in its pools at
    or before its start came from a process a stall hit within :data:`FOLLOW_UP_WINDOW`
    after it, and it ended within ``sweep`` (plus that window) of the stall.
    """
    releases = sorted((t for t in stream if t.kind in ("settled", "requeued")), key=lambda t: t.at)
    hits = list(stalls)
    found = []
    for episode in episodes:
        before = [t for t in releases if t.pool in episode.demand and t.at <= episode.start]
        if not before:
            continue
        last = before[-1]
        worker, pid = releasers.get(last.entry, ("", 0))
        for stall in hits:
            if not last.at <= stall.at <= last.at + FOLLOW_UP_WINDOW:
                continue
            if not ((stall.worker and stall.worker == worker) or (stall.pid and stall.pid == pid)):
                continue
            if episode.end <= stall.at + sweep + FOLLOW_UP_WINDOW:
                found.append(episode)
                break
    return found


#: A multi-pool head is admitted by the Python pass, which waits for the locks of all its
#: pools (it never leaves its work to a holder), and the database records its admission
#: after that wait while a release is recorded before its own: under the chaos run's load
#: (9 pool processes, beat and the faults on 2 cores) that skew alone reached 155 ms once
#: (2026-12-06). Its count starts at 500 ms: a multi-pool wake-up lost until the sweep
#: (every second here) is still seen when it waits half a sweep or more. (Issue 31: a run
#: with the Python pass's take of owed work disabled showed a multi-pool head waiting
#: 156 ms for a release owed behind a train of Python passes that did not take it; they
#: take it now. Multi-pool heads still wait behind such a train's lock waits: up to 95 ms
#: in three runs with the take, 2026-12-06.)
MULTI_POOL_THRESHOLD = 0.5
