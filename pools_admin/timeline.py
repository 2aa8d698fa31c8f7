"""The occupancy timeline of a pool: who held which slots when, drawn as SVG on the server.

Each holder is an interval ``[admitted_at, finished_at or now)`` that occupies as many
*lanes* (slot rows) as it holds slots. Lanes are assigned greedily in order of start
time: a holder takes the lowest lanes that are free when it starts. Since a pool never
holds more slots than its capacity, the lanes in use at any moment are exactly the
slots held then, and no two holders that overlap in time ever share a lane. (When the
data says otherwise, e.g. after a capacity change, extra lanes are added above the
capacity and flagged rather than drawn on top of each other.)

Geometry only: the template turns :class:`Timeline` into ``<svg>`` elements.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.utils import timezone

#: Windows offered by the page (``?window=``), in the order they are listed.
WINDOWS: dict[str, timedelta] = {
    "1m": timedelta(minutes=1),  # bodies of a second or two are still bars, not slivers
    "5m": timedelta(minutes=5),
    "15m": timedelta(minutes=15),
    "1h": timedelta(hours=1),
    "6h": timedelta(hours=6),
    "24h": timedelta(hours=24),
}
DEFAULT_WINDOW = "15m"

#: Drawing constants (SVG user units; the picture scales to the page width).
WIDTH = 880
LABEL_W = 64  # left margin holding "slot 1" ... labels
LANE_H = 22
LANE_GAP = 4
AXIS_H = 26
#: Tick spacings tried in order until fewer than ~8 ticks fit the window.
_TICKS = [timedelta(seconds=s) for s in (10, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800)]


@dataclass(frozen=True, kw_only=True)
class Hold:
    """One entry's claim on one pool over time (the input of the layout)."""

    queue_id: int
    key: str
    task_name: str
    slots: int
    state: str
    #: When the slots were granted.
    start: datetime
    #: When the worker started the body (``None`` while only admitted).
    started: datetime | None
    #: When the slots were released; ``None`` while still held.
    end: datetime | None
    worker: str = ""
    #: Highlighted (an entry of the run the page is about).
    mine: bool = False


@dataclass(frozen=True, kw_only=True)
class Bar:
    """One rectangle: a holder on one lane."""

    hold: Hold
    lane: int
    x: float
    width: float
    #: Where the "admitted, not started yet" part ends (equal to ``x`` when unknown).
    started_x: float
    y: float
    height: float
    #: Still held at the end of the window (drawn open-ended).
    ongoing: bool
    #: On a lane above the pool's capacity (inconsistent data; drawn flagged).
    over: bool

    @property
    def label(self) -> str:
        """Tooltip text: task, key, slots and times."""
        h = self.hold
        end = "still held" if h.end is None else f"released {_clock(h.end)}"
        started = f", body started {_clock(h.started)}" if h.started else ""
        worker = f" on {h.worker}" if h.worker else ""
        return (
            f"{h.task_name} [{h.key}] #{h.queue_id}: {h.slots} slot{'s' * (h.slots != 1)}"
            f"{worker}, admitted {_clock(h.start)}{started}, {end} ({h.state})"
        )

    @property
    def pending_width(self) -> float:
        """Width of the "admitted, body not started" part at the start of the bar."""
        if self.hold.started is None:
            return self.width
        part = self.started_x - self.x
        return round(min(part, self.width), 1) if part >= 1 else 0.0

    @property
    def text_x(self) -> float:
        """Where the in-bar label starts."""
        return self.x + 4

    @property
    def text_y(self) -> float:
        """Baseline of the in-bar label."""
        return self.y + self.height / 2 + 4

    @property
    def short(self) -> str:
        """A label that fits the bar, or '' when the bar is too narrow for any."""
        name = self.hold.task_name.rsplit(".", 1)[-1]
        room = int((self.width - 8) / 6.5)  # ~6.5 units per character at 11px
        if room < 3:
            return ""
        return name if len(name) <= room else name[: room - 1] + "…"


@dataclass(frozen=True, kw_only=True)
class Tick:
    """One time mark on the axis."""

    x: float
    label: str


@dataclass(kw_only=True)
class Timeline:
    """A laid-out timeline of one pool over one window."""

    pool: str
    capacity: int
    start: datetime
    end: datetime
    lanes: int
    bars: list[Bar] = field(default_factory=list)
    ticks: list[Tick] = field(default_factory=list)
    #: Holders left out because the query limit was reached.
    truncated: bool = False
    #: The window ends now (the right edge is drawn as the "now" line).
    live: bool = True

    @property
    def height(self) -> int:
        """Total SVG height."""
        return self.lanes * (LANE_H + LANE_GAP) + AXIS_H

    @property
    def width(self) -> int:
        """Total SVG width (user units)."""
        return WIDTH

    @property
    def axis_y(self) -> int:
        """Y of the time axis line."""
        return self.lanes * (LANE_H + LANE_GAP)

    @property
    def plot_width(self) -> int:
        """Width of the time area."""
        return WIDTH - LABEL_W

    @property
    def lane_rows(self) -> list[tuple[int, float, bool]]:
        """``(slot number, y, over capacity)`` of each lane, for the grid and labels."""
        return [(i + 1, i * (LANE_H + LANE_GAP), i >= self.capacity) for i in range(self.lanes)]

    @property
    def plot_left(self) -> int:
        """X where time starts."""
        return LABEL_W

    @property
    def plot_right(self) -> int:
        """X where time ends."""
        return WIDTH

    @property
    def holders(self) -> list[Hold]:
        """Each holder once, in order of start (for the table beside the picture)."""
        seen: dict[int, Hold] = {}
        for bar in self.bars:
            seen.setdefault(bar.hold.queue_id, bar.hold)
        return sorted(seen.values(), key=lambda h: (h.start, h.queue_id))


def _clock(at: datetime) -> str:
    return timezone.localtime(at).strftime("%H:%M:%S")


def assign_lanes(holds: Iterable[Hold], capacity: int, now: datetime) -> list[tuple[Hold, int]]:
    """Give each hold ``slots`` lanes so that holds overlapping in time never share one.

    Returns ``(hold, lane)`` pairs (one per lane a hold occupies), lanes numbered from 0.
    Greedy by start time with the lowest free lanes first; lanes beyond ``capacity`` are
    used only when the holds overlap by more than the capacity.
    """
    ordered = sorted(holds, key=lambda h: (h.start, h.queue_id))
    free: list[int] = list(range(capacity))  # a heap of lane numbers free now
    heapq.heapify(free)
    busy: list[tuple[datetime, int]] = []  # (end, lane) of lanes in use
    next_lane = capacity
    out: list[tuple[Hold, int]] = []
    for hold in ordered:
        while busy and busy[0][0] <= hold.start:
            _, lane = heapq.heappop(busy)
            heapq.heappush(free, lane)
        end = hold.end or now
        if end < hold.start:  # clock skew between processes: keep it visible, one instant
            end = hold.start
        for _ in range(hold.slots):
            if free:
                lane = heapq.heappop(free)
            else:
                lane, next_lane = next_lane, next_lane + 1
            heapq.heappush(busy, (end, lane))
            out.append((hold, lane))
    return out


def layout(
    pool: str,
    capacity: int,
    holds: Sequence[Hold],
    *,
    start: datetime,
    end: datetime,
    truncated: bool = False,
    now: datetime | None = None,
) -> Timeline:
    """Lay out ``holds`` of ``pool`` over ``[start, end]`` (``end`` is usually ``now``)."""
    span = (end - start).total_seconds() or 1.0
    plot_w = WIDTH - LABEL_W

    def x_of(at: datetime) -> float:
        secs = min(max((at - start).total_seconds(), 0.0), span)
        return LABEL_W + plot_w * secs / span

    placed = assign_lanes(holds, capacity, end)
    lanes = max([capacity, *(lane + 1 for _, lane in placed)])
    bars: list[Bar] = []
    for hold, lane in placed:
        x0 = x_of(hold.start)
        x1 = x_of(hold.end or end)
        width = max(x1 - x0 - 1.0, 2.0)  # 1 unit gap between holders; an instant stays visible
        bars.append(
            Bar(
                hold=hold,
                lane=lane,
                x=round(x0, 1),
                width=round(width, 1),
                started_x=round(x_of(hold.started), 1) if hold.started else round(x0, 1),
                y=lane * (LANE_H + LANE_GAP),
                height=LANE_H,
                ongoing=hold.end is None,
                over=lane >= capacity,
            )
        )
    return Timeline(
        pool=pool,
        capacity=capacity,
        start=start,
        end=end,
        lanes=lanes,
        bars=bars,
        ticks=_ticks(start, end, x_of),
        truncated=truncated,
        live=now is None or end >= now,
    )


def _ticks(start: datetime, end: datetime, x_of: object) -> list[Tick]:
    span = end - start
    step = next((t for t in _TICKS if span / t <= 8), _TICKS[-1])
    local_start = timezone.localtime(start)
    # First multiple of ``step`` after the start, counted from local midnight.
    midnight = local_start.replace(hour=0, minute=0, second=0, microsecond=0)
    n = -(-(local_start - midnight) // step)
    at = midnight + n * step
    fmt = "%H:%M:%S" if step < timedelta(minutes=1) else "%H:%M"
    ticks = []
    while at <= end:
        ticks.append(Tick(x=round(x_of(at), 1), label=at.strftime(fmt)))  # type: ignore[operator]
        at += step
    return ticks


def overlaps(bars: Sequence[Bar]) -> list[tuple[Bar, Bar]]:
    """Pairs of bars on the same lane whose time intervals overlap (should be none)."""
    by_lane: dict[int, list[Bar]] = {}
    for bar in bars:
        by_lane.setdefault(bar.lane, []).append(bar)
    found = []
    for lane_bars in by_lane.values():
        lane_bars.sort(key=lambda b: b.hold.start)
        for a, b in itertools.pairwise(lane_bars):
            a_end = a.hold.end
            if a_end is None or a_end > b.hold.start:
                found.append((a, b))
    return found
