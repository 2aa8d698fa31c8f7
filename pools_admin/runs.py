"""What the run panel shows: the tasks of one workflow run and the occupancy of their pools.

A run is every entry whose ``root_id`` is the run's id, plus the root entry itself
(Celery leaves ``root_id`` empty or equal to its own id on the first task). The panel
costs a fixed number of queries: the run's entries, their pools, the "why" of the
waiting ones (:mod:`pools_admin.why`, ``2 + 3 x pools``), one for the holders drawn
on the timelines and two for the run's budget and spend (:mod:`pools.core.budgets`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db.models import Q
from django.utils import timezone

from pools.core import budgets
from pools.core import explain as core
from pools.models import Demand, Pool, QueueEntry
from pools.states import HELD_STATES, TERMINAL_STATES, EntryState
from pools_admin import timeline, why

#: Tasks listed per run (a larger run says how many were left out).
MAX_TASKS = 500
#: Holders drawn per pool timeline.
MAX_HOLDS = 400
#: Recent terminal entries listed per pool on the pool page.
RECENT = 15


@dataclass(frozen=True, kw_only=True)
class TaskRow:
    """One task of the run."""

    entry: QueueEntry
    #: ``[(pool, slots)]`` by pool name.
    demand: list[tuple[str, int]]
    #: "Why is it waiting", for waiting entries.
    explanation: core.Explanation | None = None

    @property
    def held_slots(self) -> int:
        """Slots this entry holds now (over all its pools)."""
        return sum(s for _, s in self.demand) if self.entry.state in HELD_STATES else 0

    @property
    def short_name(self) -> str:
        """The task's name without its module."""
        return self.entry.task_name.rsplit(".", 1)[-1]


@dataclass(frozen=True, kw_only=True)
class BudgetRow:
    """One kind of budget of a run: its limit (None: unlimited), the spend, if it stopped it."""

    kind: str
    limit: float | None
    spent: float
    stopped: bool

    @property
    def percent(self) -> int:
        """Spent share of the limit, 0-100 (0 without a limit)."""
        if not self.limit:
            return 0
        return min(round(100 * self.spent / self.limit), 100)


@dataclass(kw_only=True)
class RunPanel:
    """The run panel of one run (or of one entry, which is then ``focus``)."""

    root_id: str
    now: datetime
    window: str
    active: list[TaskRow] = field(default_factory=list)
    finished: list[TaskRow] = field(default_factory=list)
    timelines: list[timeline.Timeline] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    #: More tasks than :data:`MAX_TASKS` exist in the run.
    truncated: bool = False
    focus: QueueEntry | None = None
    #: The run's budget and spend so far (``None``: the run has no budget).
    budget: budgets.Spend | None = None

    @property
    def budget_rows(self) -> list[BudgetRow]:
        """One row per kind of budget the run has a limit for, or spends."""
        if self.budget is None:
            return []
        b = self.budget
        return [
            BudgetRow(
                kind=kind,
                limit=b.limits.get(kind),
                spent=b.spent[kind],
                stopped=b.stopped_by == kind,
            )
            for kind in ("seconds", "cost", "tokens")
            if kind in b.limits or b.spent[kind]
        ]

    @property
    def total(self) -> int:
        """Tasks listed."""
        return len(self.active) + len(self.finished)


#: The run panel's extra window: the run's own span (its first admission to its last
#: release, or to now while any of it is waiting or held).
FIT = "run"
#: Shortest span the "run" window shows.
MIN_FIT = timedelta(seconds=10)


def window_of(value: str | None, *, allow_fit: bool = False, default: str | None = None) -> str:
    """A known window name (``?window=``), ``default`` (or the default window) otherwise."""
    if value in timeline.WINDOWS or (allow_fit and value == FIT):
        return str(value)
    return default or timeline.DEFAULT_WINDOW


def fit_span(entries: list[QueueEntry], now: datetime) -> tuple[datetime, datetime]:
    """The "run" window: from the run's first admission (or enqueue) to now, or to its last
    release once every task has finished; at least :data:`MIN_FIT`, with a small margin."""
    if not entries:
        return now - MIN_FIT, now
    first = min(e.admitted_at or e.enqueued_at for e in entries)
    finished = all(e.state in TERMINAL_STATES for e in entries)
    last = max(e.finished_at or now for e in entries) if finished else now
    span = max(last - first, MIN_FIT)
    margin = span * 0.025
    return last - span - margin, min(last + margin, now)


def default_window(entries: list[QueueEntry], now: datetime) -> str:
    """The run panel's window when none is asked for: the run's own span, so a run of a few
    seconds fills the picture, except for a run still going after longer than the default
    window, which shows its recent activity."""
    start, end = fit_span(entries, now)
    long = end - start > timeline.WINDOWS[timeline.DEFAULT_WINDOW]
    return timeline.DEFAULT_WINDOW if long and end >= now else FIT


def run_entries(root_id: str) -> tuple[list[QueueEntry], bool]:
    """The run's entries (first :data:`MAX_TASKS` by queue id) and whether there are more."""
    rows = list(
        QueueEntry.objects.filter(Q(root_id=root_id) | Q(key=root_id)).order_by("queue_id")[
            : MAX_TASKS + 1
        ]
    )
    return rows[:MAX_TASKS], len(rows) > MAX_TASKS


def holds_of(
    pools: list[Pool], start: datetime, end: datetime, mine: set[int]
) -> dict[int, tuple[list[timeline.Hold], bool]]:
    """Holders of each pool that overlap ``[start, end]`` (one query), and if any were cut."""
    if not pools:
        return {}
    rows = (
        Demand.objects.filter(
            pool_id__in=[p.pk for p in pools],
            entry__admitted_at__isnull=False,
            entry__admitted_at__lt=end,
        )
        .filter(
            Q(state__in=HELD_STATES) | Q(state__in=TERMINAL_STATES, entry__finished_at__gt=start)
        )
        .select_related("entry")
        .order_by("-entry__admitted_at")[: MAX_HOLDS * len(pools)]
    )
    out: dict[int, tuple[list[timeline.Hold], bool]] = {p.pk: ([], False) for p in pools}
    for d in rows:
        e = d.entry
        holds, _ = out[d.pool_id]
        if len(holds) >= MAX_HOLDS:
            out[d.pool_id] = (holds, True)
            continue
        end_at = e.finished_at if d.state in TERMINAL_STATES else None
        if e.admitted_at is None or (d.state in TERMINAL_STATES and end_at is None):
            continue  # finished without a time: nothing to draw
        holds.append(
            timeline.Hold(
                queue_id=e.queue_id,
                key=e.key,
                task_name=e.task_name,
                slots=d.slots,
                state=d.state,
                start=e.admitted_at,
                started=e.started_at,
                end=end_at,
                worker=e.worker,
                mine=e.queue_id in mine,
            )
        )
    return out


def timelines_for(
    pools: list[Pool],
    *,
    window: str,
    now: datetime,
    mine: set[int],
    span: tuple[datetime, datetime] | None = None,
) -> list[timeline.Timeline]:
    """One laid-out timeline per pool over the last ``window`` (or over ``span``)."""
    start, end = span or (now - timeline.WINDOWS[window], now)
    holds = holds_of(pools, start, end, mine)
    return [
        timeline.layout(
            p.name,
            p.slots,
            holds[p.pk][0],
            start=start,
            end=end,
            truncated=holds[p.pk][1],
            now=now,
        )
        for p in pools
    ]


def load(
    root_id: str,
    *,
    window: str | None = None,
    now: datetime | None = None,
    focus: QueueEntry | None = None,
) -> RunPanel:
    """The run panel of ``root_id``."""
    now = now or timezone.now()
    entries, truncated = run_entries(root_id)
    if focus is not None and all(e.queue_id != focus.queue_id for e in entries):
        entries.append(focus)  # an entry of a run cut at MAX_TASKS is still shown
    window = window_of(window, allow_fit=True, default=default_window(entries, now))
    names = sorted({name for e in entries for name in e.demand})
    pools = {p.name: p for p in Pool.objects.filter(name__in=names).order_by("name")}
    explained = why.explain_entries(entries, pools, now)
    panel = RunPanel(root_id=root_id, now=now, window=window, truncated=truncated, focus=focus)
    panel.budget = budgets.spend(root_id)
    for e in entries:
        row = TaskRow(
            entry=e,
            demand=sorted((n, int(s)) for n, s in e.demand.items()),
            explanation=explained.get(e.queue_id),
        )
        (panel.finished if e.state in TERMINAL_STATES else panel.active).append(row)
    # Active work in line order of the run (holders first), finished work newest first.
    rank: dict[str, int] = {EntryState.RUNNING: 0, EntryState.ADMITTED: 1, EntryState.WAITING: 2}
    panel.active.sort(key=lambda r: (rank.get(r.entry.state, 3), r.entry.queue_id))
    panel.finished.sort(
        key=lambda r: (r.entry.finished_at or r.entry.enqueued_at, r.entry.queue_id), reverse=True
    )
    panel.counts = dict(Counter(e.state for e in entries))
    panel.timelines = timelines_for(
        list(pools.values()),
        window=window,
        now=now,
        mine={e.queue_id for e in entries},
        span=fit_span(entries, now) if window == FIT else None,
    )
    return panel


@dataclass(kw_only=True)
class PoolPage:
    """The occupancy page of one pool."""

    pool: Pool
    now: datetime
    window: str
    timeline: timeline.Timeline
    recent: list[QueueEntry]


def load_pool(pool: Pool, *, window: str | None = None, now: datetime | None = None) -> PoolPage:
    """The timeline of ``pool`` and its recent terminal entries (two queries)."""
    now = now or timezone.now()
    window = window_of(window)
    (line,) = timelines_for([pool], window=window, now=now, mine=set())
    recent = list(
        QueueEntry.objects.filter(
            state__in=TERMINAL_STATES,
            finished_at__isnull=False,
            finished_at__gte=now - timedelta(days=1),
            demands__pool=pool,
        ).order_by("-finished_at")[:RECENT]
    )
    return PoolPage(pool=pool, now=now, window=window, timeline=line, recent=recent)
