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
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any


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


# --------------------------------------------------------------------------- lost wake-ups


@dataclass(frozen=True)
class Span:
    """An entry waiting (enqueued .. admitted) or holding slots (admitted .. released), with
    the pools it names. ``until`` None: still so when the record ends."""

    demand: dict[str, int]
    since: float
    until: float | None
    entry: int | None = None


def idle_waits(
    waits: Iterable[Span],
    holds: Iterable[Span],
    pools: Iterable[str],
    *,
    end: float,
    longer_than: float = 0.1,
) -> list[str]:
    """Moments when an entry waited longer than ``longer_than`` (seconds) while every slot
    of every pool was free: a lost wake-up (an admission owed and nobody running it).

    Every pool idle is the condition, not only the waiting entry's pools: the recorder
    does not know the line's order, and a head naming a busy pool legitimately blocks an
    idle one. With every pool idle any due head fits, so some admission is owed. Records
    are written after the fact (a wait opens after its enqueue returned, a hold closes
    after its settle returned and opens when its admission was recorded): each recorded
    hold lies inside or around the real one, so the one error is an admission recorded
    late, and the threshold (100 ms) is far above that lag. At one instant, what ends
    idleness (a hold opens, a wait ends) counts first: a tie never makes a moment idle.
    """
    names = set(pools)
    points: list[tuple[float, int, str, dict[str, int]]] = []
    for w in waits:
        until = end if w.until is None else w.until
        if until > w.since:
            points.append((w.since, 1, "wait+", w.demand))
            points.append((until, 0, "wait-", w.demand))
    for h in holds:
        until = end if h.until is None else h.until
        if until > h.since:
            points.append((h.since, 0, "hold+", h.demand))
            points.append((until, 1, "hold-", h.demand))
    points.sort(key=lambda p: (p[0], p[1]))
    held: dict[str, int] = defaultdict(int)
    waiting = 0
    found: list[str] = []
    idle_since: float | None = None

    def idle() -> bool:
        return waiting > 0 and all(held[n] <= 0 for n in names)

    for at, _order, kind, demand in points:
        if kind == "wait+":
            waiting += 1
        elif kind == "wait-":
            waiting -= 1
        else:
            for pool, slots in demand.items():
                held[pool] += slots if kind == "hold+" else -slots
        if idle():
            if idle_since is None:
                idle_since = at
        elif idle_since is not None:
            if at - idle_since > longer_than:
                found.append(f"an entry waited {at - idle_since:.3f}s with every slot free")
            idle_since = None
    if idle_since is not None and end - idle_since > longer_than:
        found.append(f"an entry waited {end - idle_since:.3f}s with every slot free, to the end")
    return found
