"""Lost wake-ups, counted: due heads of a line that waited while the slots they ask for were free.

Shared by the contention harness (:mod:`tests.support.contention`, from its own recorder) and
the chaos checker (:mod:`tests.chaos.check`, from the database's record of every transition).
Each builds :class:`Stay` and :class:`Hold` records from what it saw; :func:`starved_heads`
walks them and returns every **episode**: an entry E that was, for longer than ``threshold``
seconds without a break,

* surely in line (its stay had surely begun and had not ended),
* surely the head of the line of every pool it asks for, in the engine's line order
  (``(-priority, enqueued_at)``, the ``priority`` strategy without aging), and
* such that in each of those pools ``capacity - held >= `` its demand, where held counts the
  :class:`Hold` intervals open at that instant,

outside the ``excluded`` windows (e.g. while the database was down). The admission pass
admits exactly such an entry (a multi-pool entry only when it heads every line it is in,
``admission_pass._fits_everywhere``), so in a correct engine each such stretch is only as
long as the bookkeeping delay between a commit and its record: far below 100 ms.

Uncertainty always goes to the engine (no false alarm from a record written late):

* an entry's enqueue time is known as a bracket ``[enqueued_lo, enqueued_hi]`` (the
  recorder's time before the enqueue call and after it returned); an entry F is *possibly
  ahead* of E when its priority is higher, or equal and ``F.enqueued_lo <= E.enqueued_hi``;
* an entry counts as possibly in line (so possibly ahead of others) from
  ``possibly_from`` (before its enqueue could have committed), but can only be a starved
  head from ``surely_from`` (once its enqueue has surely committed);
* the callers open holds no later than the real admission's record and close them no
  earlier than the real release's (so free slots are never over-counted by design).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

#: A head waiting longer than this (seconds) with its slots free is a lost wake-up.
THRESHOLD = 0.1
#: An end that never came.
FOREVER = float("inf")


@dataclass(frozen=True)
class Stay:
    """One stretch of an entry in the lines of its pools (enqueue or requeue .. admission)."""

    entry: int
    #: Slots asked per pool.
    demand: Mapping[str, int]
    priority: int
    #: Earliest and latest moment its ``enqueued_at`` (its place in line) can have been taken.
    enqueued_lo: float
    enqueued_hi: float
    #: From when it may be in line (possibly ahead of others).
    possibly_from: float
    #: From when it is surely in line (and may be counted as a starved head).
    surely_from: float
    #: When it left the line (admitted, cancelled, expired...); :data:`FOREVER` if never.
    until: float = FOREVER


@dataclass(frozen=True)
class Hold:
    """Slots counted as held from ``start`` to ``end`` (admission .. release)."""

    demand: Mapping[str, int]
    start: float
    end: float = FOREVER


@dataclass(frozen=True)
class Episode:
    """A head that waited with free slots from ``start`` to ``end``."""

    entry: int
    demand: Mapping[str, int]
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def __str__(self) -> str:
        pools = ", ".join(f"{p} {n}" for p, n in sorted(self.demand.items()))
        return f"entry {self.entry} ({pools}) head with free slots for {self.seconds * 1000:.0f} ms"


def _possibly_ahead(f: Stay, e: Stay) -> bool:
    """Whether ``f`` may stand before ``e`` in a line, by ``(-priority, enqueued_at)``."""
    return f.priority > e.priority or (f.priority == e.priority and f.enqueued_lo <= e.enqueued_hi)


def sure_heads(members: Sequence[Stay], t: float) -> Stay | None:
    """The stay surely at the head of a line whose possible members are ``members`` at ``t``.

    Only the member with the least ``(-priority, enqueued_lo)`` can be; it is if it is surely
    in line and no other member is possibly ahead of it.
    """
    if not members:
        return None
    head = min(members, key=lambda s: (-s.priority, s.enqueued_lo))
    if head.surely_from > t:
        return None
    if any(f is not head and _possibly_ahead(f, head) for f in members):
        return None
    return head


def _held_at(holds: Iterable[Hold], t: float) -> dict[str, int]:
    held: dict[str, int] = defaultdict(int)
    for h in holds:
        if h.start <= t < h.end:
            for pool, n in h.demand.items():
                held[pool] += n
    return held


def starved_heads(
    stays: Sequence[Stay],
    holds: Sequence[Hold],
    capacity: Mapping[str, int],
    *,
    threshold: float = THRESHOLD,
    excluded: Sequence[tuple[float, float]] = (),
    multi_pool_threshold: float | None = None,
) -> list[Episode]:
    """Every episode (see the module docstring) longer than ``threshold`` seconds (an
    entry of several pools: ``multi_pool_threshold``, when given).

    State only changes at the ends of stays, holds and excluded windows, so it is
    evaluated once per stretch between two consecutive such times.
    """
    cuts = sorted(
        {s.possibly_from for s in stays}
        | {s.surely_from for s in stays}
        | {s.until for s in stays}
        | {h.start for h in holds}
        | {h.end for h in holds}
        | {t for window in excluded for t in window}
    )
    cuts = [t for t in cuts if t != FOREVER]
    by_start = sorted(stays, key=lambda s: s.possibly_from)
    holds_by_start = sorted(holds, key=lambda h: h.start)
    live: list[Stay] = []
    open_holds: list[Hold] = []
    nxt = nxt_hold = 0
    running: dict[int, Episode] = {}
    found: list[Episode] = []
    for i, t in enumerate(cuts):
        end = cuts[i + 1] if i + 1 < len(cuts) else FOREVER
        while nxt < len(by_start) and by_start[nxt].possibly_from <= t:
            live.append(by_start[nxt])
            nxt += 1
        while nxt_hold < len(holds_by_start) and holds_by_start[nxt_hold].start <= t:
            open_holds.append(holds_by_start[nxt_hold])
            nxt_hold += 1
        live = [s for s in live if s.until > t]
        open_holds = [h for h in open_holds if h.end > t]
        starving: dict[int, Stay] = {}
        if not any(a <= t < b for a, b in excluded):
            starving = {s.entry: s for s in _starving_at(live, open_holds, capacity, t)}
        for entry in [e for e in running if e not in starving]:
            episode = running.pop(entry)
            _close(episode, t, _limit(episode, threshold, multi_pool_threshold), found)
        for entry, stay in starving.items():
            if entry not in running:
                running[entry] = Episode(entry, stay.demand, t, t)
        if end == FOREVER:
            for episode in running.values():
                _close(episode, FOREVER, _limit(episode, threshold, multi_pool_threshold), found)
            running.clear()
    return sorted(found, key=lambda e: (e.start, e.entry))


def _limit(episode: Episode, threshold: float, multi_pool: float | None) -> float:
    return multi_pool if multi_pool is not None and len(episode.demand) > 1 else threshold


def _close(episode: Episode, end: float, threshold: float, found: list[Episode]) -> None:
    if end - episode.start > threshold:
        found.append(Episode(episode.entry, episode.demand, episode.start, end))


def _starving_at(
    live: Sequence[Stay], holds: Sequence[Hold], capacity: Mapping[str, int], t: float
) -> list[Stay]:
    """The stays that are, at ``t``, surely head of all their lines and fit in every pool."""
    lines: dict[str, list[Stay]] = defaultdict(list)
    for s in live:
        for pool in s.demand:
            lines[pool].append(s)
    heads = {pool: sure_heads(members, t) for pool, members in lines.items()}
    held = _held_at(holds, t)
    out = []
    for head in {h.entry: h for h in heads.values() if h is not None}.values():
        if all(heads.get(p) is head for p in head.demand) and all(
            capacity.get(p, 0) - held.get(p, 0) >= n for p, n in head.demand.items()
        ):
            out.append(head)
    return out


def per_pool(episodes: Iterable[Episode]) -> dict[str, int]:
    """How many episodes involve each pool (a multi-pool head counts in each of its pools)."""
    counts: dict[str, int] = defaultdict(int)
    for e in episodes:
        for pool in e.demand:
            counts[pool] += 1
    return dict(counts)
