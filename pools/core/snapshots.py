"""Read-only, point-in-time views of pools for the CLI, admin, REST API and demo.

Every function reads with a fixed number of queries, whatever the depth of the lines
(the REST list endpoints and the admin card poll them):

- :func:`snapshot_all`: 5 queries for any number of pools (+1 when a head entry names a
  pool outside the set); :func:`snapshot`: the same for one pool;
- :func:`pools.core.entry_pages.entries_page` (built from the helpers here): at most 7
  queries per page.

The heads of the lines are read with one correlated subquery per head place, each a short
range of the ``pools_demand_line`` index; counts per state are one grouped count over the
pools' unfinished demand rows; ``recent`` terminal entries and the hold times of the ETA
come from one query over what finished within :data:`pools.core.line_places.HOLD_WINDOW`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from django.db.models import (
    Case,
    CharField,
    Count,
    F,
    JSONField,
    OuterRef,
    QuerySet,
    Subquery,
    When,
)
from django.utils import timezone

from pools.core import explain, line_places, overrides, rates, spendcap
from pools.core.explain import PoolView
from pools.exceptions import UnknownPool
from pools.models import Demand, Pool, PoolOverride, QueueEntry
from pools.querysets import LINE_ORDER, held_slots_expr
from pools.states import HELD_STATES, TERMINAL_STATES, EntryState

#: Demand states of unfinished entries, counted per pool (``delayed``: not due yet).
ACTIVE_STATES = ("waiting", "delayed", "admitted", "running")
#: States always present in ``counts`` (0 when none).
COUNTED_STATES = ("waiting", "admitted", "running")


@dataclass(frozen=True, kw_only=True)
class LineItem:
    """One entry as seen from one pool."""

    queue_id: int
    key: str
    task_name: str
    state: EntryState
    priority: int
    slots: int
    #: 1-based place in the pool's line (waiting entries only).
    position: int | None
    enqueued_at: datetime
    deadline: datetime | None
    lease_expires_at: datetime | None
    worker: str
    not_before: datetime | None = None
    admitted_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    #: Why a terminal entry ended (``queue_timeout``, ``revoked``, ...).
    reason: str = ""
    origin: str = ""
    attempt: int = 0
    root_id: str = ""
    #: Every pool the entry asks for, ``{name: slots}``.
    demand: dict[str, int] = field(default_factory=dict)
    #: Whom the entry is fair to in pools with strategy ``fair`` ("" when none).
    fairness_key: str = ""
    #: Waiting entries: one of :data:`pools.core.explain.BLOCKERS`, or ``None`` if admissible.
    blocked_by: str | None = None
    #: Waiting entries: the human sentence of :mod:`pools.core.explain`.
    message: str = ""
    #: Waiting entries: estimated admission time (``None`` when unknown).
    eta: datetime | None = None


@dataclass(frozen=True, kw_only=True)
class PoolSnapshot:
    """Capacity, occupancy and the head of the line of one pool."""

    name: str
    slots: int
    held: int
    waiting: int
    paused: bool
    max_queued: int | None
    holders: list[LineItem]
    head: list[LineItem]
    #: Slots in effect for admission: the old capacity while the pool drains after a
    #: capacity change (``slots`` is the configured one).
    capacity: int = 0
    #: A capacity change waits for the entries queued before it to be admitted.
    draining: bool = False
    #: What a submit does when the backlog is full / while paused.
    overflow: str = "reject"
    paused_policy: str = "queue"
    #: The admission order (:class:`pools.models.Strategy`) and its aging, if any.
    strategy: str = "priority"
    aging_seconds: int | None = None
    #: Daily spend cap in slot-seconds (``None``: no cap) and the spend of today (UTC).
    spend_cap: float | None = None
    spent_today: float = 0.0
    #: Rate limits on starts (``["10/s", "100000/d"]``; empty: none; :mod:`pools.core.rates`).
    rate: list[str] = field(default_factory=list)
    #: Removed from settings while it held or queued work: deleted once empty.
    retiring: bool = False
    #: End of the pool's backoff (a timed pause a task asked for: ``paused`` is true until
    #: then; :mod:`pools.core.backoffs`); ``None`` when it is not backing off.
    backoff_until: datetime | None = None
    #: Backoffs asked of this pool so far.
    backoffs: int = 0
    #: Unfinished entries per demand state (``waiting``, ``admitted``, ``running``, ...).
    counts: dict[str, int] = field(default_factory=dict)
    #: The latest terminal entries (finished within the hold window), newest first.
    recent: list[LineItem] = field(default_factory=list)
    description: str = ""
    defined_in_settings: bool = False
    #: Mean hold time of recent entries (the ETA's basis); ``None`` without history.
    mean_hold: timedelta | None = None
    #: The ``POOLS["TEMPLATES"]`` pattern of a per-key pool ("" for other pools).
    template: str = ""
    #: A per-key pool's overridden limits: ``{field: {"value": ..., "template": ...}}``
    #: (:mod:`pools.core.overrides`); empty when it has none.
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def override_labels(self) -> list[str]:
        """``["slots 8 (override; template 2)", ...]``."""
        return overrides.labels(self.overrides)

    @property
    def free(self) -> int:
        """Slots not held (never negative)."""
        return max((self.capacity or self.slots) - self.held, 0)

    @property
    def running(self) -> list[LineItem]:
        """The holders (admitted or running entries)."""
        return self.holders


# --------------------------------------------------------------------------- items


def item(d: Demand, position: int | None = None, **extra: Any) -> LineItem:
    """A :class:`LineItem` from a demand row with its entry loaded."""
    e: QueueEntry = d.entry
    return LineItem(
        queue_id=e.queue_id,
        key=e.key,
        task_name=e.task_name,
        state=EntryState(e.state),  # the model field reads back a plain str
        priority=e.priority,
        slots=d.slots,
        position=position,
        enqueued_at=e.enqueued_at,
        deadline=e.deadline,
        lease_expires_at=e.lease_expires_at,
        worker=e.worker,
        not_before=e.not_before,
        admitted_at=e.admitted_at,
        started_at=e.started_at,
        finished_at=e.finished_at,
        reason=e.reason,
        origin=e.origin,
        attempt=e.attempt,
        root_id=e.root_id,
        demand=dict(e.demand),
        fairness_key=e.fairness_key,
        **extra,
    )


#: Entry columns never needed by a view (the held message can be large).
_HEAVY = ("entry__args", "entry__kwargs", "entry__options")


def view_rows(qs: QuerySet[Any]) -> QuerySet[Any]:
    return qs.select_related("entry").defer(*_HEAVY)


# --------------------------------------------------------------------------- bulk reads


def _head_names(n: int) -> list[str]:
    return [f"_head{i}" for i in range(n)]


def _with_heads(qs: QuerySet[Pool], n: int) -> QuerySet[Pool]:
    """Annotate each pool with the demand row ids of its first ``n`` line places."""
    annotations: dict[str, Any] = {
        name: Subquery(
            Demand.objects.filter(pool_id=OuterRef("pk"), state=EntryState.WAITING)
            .order_by(*LINE_ORDER)
            .values("pk")[i : i + 1]
        )
        for i, name in enumerate(_head_names(n))
    }
    # A per-key pool's overrides (kept by name: they outlive the pool).
    annotations["override_values"] = Subquery(
        PoolOverride.objects.filter(pool=OuterRef("name")).values("values")[:1],
        output_field=JSONField(),
    )
    return qs.annotate(**annotations)


def _counts(pool_ids: Sequence[int]) -> dict[int, dict[str, int]]:
    out: dict[int, dict[str, int]] = {pid: dict.fromkeys(COUNTED_STATES, 0) for pid in pool_ids}
    # A held demand row stays "admitted" while its entry runs (starting a claim touches
    # the entry only): held rows count by their entry's state.
    effective = Case(
        When(state__in=HELD_STATES, then=F("entry__state")),
        default=F("state"),
        output_field=CharField(),
    )
    rows = (
        Demand.objects.filter(pool_id__in=list(pool_ids), state__in=ACTIVE_STATES)
        .annotate(effective=effective)
        .values_list("pool_id", "effective")
        .annotate(n=Count("pk"))
        .order_by()
    )
    for pool_id, state, n in rows:
        out[pool_id][state] = n
    return out


def _history(
    pool_ids: Sequence[int], now: datetime, recent: int
) -> tuple[dict[int, list[LineItem]], dict[int, list[timedelta]]]:
    """Recent terminal items and hold times per pool, from one query."""
    per_pool = max(recent, line_places.HOLD_SAMPLE)
    rows = view_rows(
        Demand.objects.filter(
            pool_id__in=list(pool_ids),
            state__in=TERMINAL_STATES,
            entry__finished_at__gte=now - line_places.HOLD_WINDOW,
        )
    ).order_by("-entry__finished_at", "-entry_id")[: per_pool * len(pool_ids)]
    items: dict[int, list[LineItem]] = {pid: [] for pid in pool_ids}
    holds: dict[int, list[timedelta]] = {pid: [] for pid in pool_ids}
    for d in rows:
        if len(items[d.pool_id]) < recent:
            items[d.pool_id].append(item(d))
        e = d.entry
        sample = holds[d.pool_id]
        if e.admitted_at and e.finished_at and len(sample) < line_places.HOLD_SAMPLE:
            if e.finished_at >= e.admitted_at:
                sample.append(e.finished_at - e.admitted_at)
    return items, holds


@dataclass(frozen=True, kw_only=True)
class Gate:
    """What decides whether a multi-pool entry is admissible in one other pool."""

    name: str
    paused: bool
    free: int
    first: int | None  # entry id of the line's head


def other_gates(names: Iterable[str], known: dict[str, Gate]) -> dict[str, Gate]:
    """Gates of the pools in ``names`` not in ``known`` (one query when any is missing)."""
    missing = sorted(set(names) - set(known))
    if not missing:
        return known
    first = (
        Demand.objects.filter(pool_id=OuterRef("pk"), state=EntryState.WAITING)
        .order_by(*LINE_ORDER)
        .values("entry_id")[:1]
    )
    out = dict(known)
    for p in Pool.objects.filter(name__in=missing).annotate(
        _held=held_slots_expr(), _first=Subquery(first)
    ):
        out[p.name] = Gate(
            name=p.name,
            paused=p.paused,
            free=max(line_places.capacity(p) - p._held, 0),
            first=p._first,
        )
    return out


def _blocked_elsewhere(e: QueueEntry, here: str, gates: dict[str, Gate]) -> tuple[str, str] | None:
    """The first other pool (by name) where ``e`` is not admissible, and why."""
    for name, slots in sorted(e.demand.items()):
        if name == here or name not in gates:
            continue
        g = gates[name]
        if g.paused:
            return name, "paused"
        if g.first != e.queue_id:
            return name, "pool_full" if g.free == 0 else "head_of_line"
        if g.free < slots:
            return name, "pool_full"
    return None


def explained_items(
    view: PoolView,
    rows: Sequence[tuple[Demand, int]],
    first: Demand | None,
    gates: dict[str, Gate],
    now: datetime,
) -> list[LineItem]:
    """Line items of waiting rows (with their positions) and why each one waits."""
    out = []
    for d, position in rows:
        e = d.entry
        place = explain.decide(view, e, d.slots, position, first if position > 1 else None, now)
        if place.blocked_by is None and len(e.demand) > 1:
            other = _blocked_elsewhere(e, view.pool.name, gates)
            if other is not None:
                place = replace(
                    place,
                    blocked_by="other_pool",
                    message=f"Admissible in pool {view.pool.name!r}, but it also waits for pool "
                    f"{other[0]!r} ({other[1]}); it takes both at once.",
                    eta=None,
                )
        out.append(
            item(d, position, blocked_by=place.blocked_by, message=place.message, eta=place.eta)
        )
    return out


def _build_many(pools: list[Pool], head: int, recent: int, now: datetime) -> list[PoolSnapshot]:
    """Snapshots of ``pools`` (annotated by :func:`_with_heads`) in four more queries."""
    if not pools:
        return []
    ids = [p.pk for p in pools]
    counts = _counts(ids)
    holders = explain.held_rows(ids)
    recent_items, holds = _history(ids, now, recent)
    head_ids = {
        getattr(p, name): p.pk for p in pools for name in _head_names(head) if getattr(p, name)
    }
    head_rows = {d.pk: d for d in view_rows(Demand.objects.filter(pk__in=list(head_ids)))}
    views = {p.pk: PoolView(pool=p, holders=holders[p.pk], holds=holds[p.pk]) for p in pools}
    gates = {
        p.name: Gate(
            name=p.name,
            paused=p.paused,
            free=views[p.pk].free,
            first=head_rows[h].entry_id if (h := getattr(p, "_head0", None)) else None,
        )
        for p in pools
        if head
    }
    lines = {
        p.pk: [head_rows[i] for n in _head_names(head) if (i := getattr(p, n)) in head_rows]
        for p in pools
    }
    multi = {name for rows in lines.values() for d in rows for name in d.entry.demand}
    if any(len(d.entry.demand) > 1 for rows in lines.values() for d in rows):
        gates = other_gates(multi, gates)
    out = []
    for p in pools:
        view = views[p.pk]
        line = lines[p.pk]
        out.append(
            PoolSnapshot(
                name=p.name,
                slots=line_places.configured(p),
                capacity=line_places.capacity(p),
                draining=p.pending_slots is not None,
                overflow=p.overflow,
                paused_policy=p.paused_policy,
                strategy=p.strategy,
                aging_seconds=p.aging_seconds,
                spend_cap=p.spend_cap,
                spent_today=spendcap.spent(p) if p.spend_cap is not None else 0.0,
                rate=rates.as_list(p.rate),
                retiring=p.retiring,
                backoff_until=p.backoff_until,
                backoffs=p.backoffs,
                held=view.held,
                waiting=counts[p.pk]["waiting"],
                counts=counts[p.pk],
                paused=p.paused,
                max_queued=p.max_queued,
                description=p.description,
                defined_in_settings=p.defined_in_settings,
                holders=[item(d) for d in view.holders],
                head=explained_items(
                    view,
                    [(d, i + 1) for i, d in enumerate(line)],
                    line[0] if line else None,
                    gates,
                    now,
                ),
                recent=recent_items[p.pk],
                mean_hold=line_places.mean_hold(holds[p.pk]),
                template=p.template,
                overrides=overrides.detail(p.template, getattr(p, "override_values", None)),
            )
        )
    return out


# --------------------------------------------------------------------------- public views


def snapshot(name: str, *, head: int = 10, recent: int = 10) -> PoolSnapshot:
    """Snapshot pool ``name`` with the first ``head`` waiting entries; 5 queries."""
    pool = _with_heads(Pool.objects.filter(name=name), head).first()
    if pool is None:
        raise UnknownPool(name)
    return _build_many([pool], head, recent, timezone.now())[0]


def snapshot_all(*, head: int = 5, recent: int = 5) -> list[PoolSnapshot]:
    """Snapshots of every pool, by name; 5 queries whatever the number of pools and entries."""
    pools = list(_with_heads(Pool.objects.order_by("name"), head))
    return _build_many(pools, head, recent, timezone.now())
