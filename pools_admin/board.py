"""What the "Resource pools" card shows, read in a fixed number of queries.

:func:`load` costs three queries whatever the number of pools and the queue depth:

1. the pools, each with its held slots, waiting count and nearest waiting deadline
   (correlated subqueries served by the ``pools_demand_line`` and deadline indexes);
2. the first :data:`HEAD` waiting demand rows of every pool (a window function);
3. the entries of those rows.

Unlike :func:`pools.core.snapshots.snapshot_all` (three queries per pool) this stays flat as
pools are added, which matters for a card that refreshes itself every few seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db.models import F, JSONField, OuterRef, Subquery, Window
from django.db.models.functions import RowNumber

from pools.core import overrides, rates
from pools.models import Demand, Pool, PoolOverride, QueueEntry
from pools.querysets import held_slots_expr, waiting_count_expr

#: Waiting entries shown per pool (the head of its line).
HEAD = 3
#: Segmented bars up to this capacity; a continuous bar above it.
MAX_SEGMENTS = 24


@dataclass(frozen=True, kw_only=True)
class HeadEntry:
    """One of the first entries in a pool's line."""

    queue_id: int
    key: str
    task_name: str
    priority: int
    slots: int
    #: 1-based place in the pool's line.
    position: int
    enqueued_at: datetime
    deadline: datetime | None
    not_before: datetime | None
    root_id: str

    @property
    def short_name(self) -> str:
        """The task's name without its module."""
        return self.task_name.rsplit(".", 1)[-1]


@dataclass(frozen=True, kw_only=True)
class PoolRow:
    """One pool as the card shows it."""

    name: str
    slots: int
    held: int
    waiting: int
    paused: bool
    max_queued: int | None
    nearest_deadline: datetime | None
    head: list[HeadEntry]
    #: The capacity a pending change drains to (docs/reference/pool-policies.md); None
    #: when no change is pending.
    pending_slots: int | None = None
    #: The pool's rates as stored (``"20/s,100/m"``); empty without a rate.
    rate: str = ""
    #: A per-key pool's overridden limits: ``["slots 8 (override; template 2)"]``.
    overrides: tuple[str, ...] = ()
    #: End of the pool's backoff (a timed pause a task asked for); None when not backing off.
    backoff_until: datetime | None = None

    @property
    def unlimited(self) -> bool:
        """True for a pool limited by its rate only (no slot limit to draw)."""
        return self.slots >= rates.UNLIMITED_SLOTS

    @property
    def rates_shown(self) -> str:
        """The rates for people: ``20/s, 100/m``."""
        return ", ".join(part for part in self.rate.split(",") if part)

    @property
    def draining(self) -> bool:
        """True while a capacity change waits for the entries queued before it."""
        return self.pending_slots is not None

    @property
    def free(self) -> int:
        """Slots not held (never negative)."""
        return max(self.slots - self.held, 0)

    @property
    def percent_held(self) -> int:
        """Held share of the capacity, 0-100 (for the continuous bar)."""
        return min(round(100 * self.held / self.slots), 100) if self.slots else 0

    @property
    def segments(self) -> list[bool] | None:
        """One flag per slot (held or not) for a segmented bar; None above MAX_SEGMENTS."""
        if self.slots > MAX_SEGMENTS:
            return None
        return [i < self.held for i in range(self.slots)]

    @property
    def over(self) -> int:
        """Slots held beyond the capacity (only while a lowered capacity drains)."""
        return max(self.held - self.slots, 0)


def _pools_query() -> list[Pool]:
    deadline = (
        QueueEntry.objects.waiting()
        .filter(deadline__isnull=False, demands__pool=OuterRef("pk"))
        .order_by("deadline")
        .values("deadline")[:1]
    )
    return list(
        Pool.objects.order_by("name").annotate(
            held_slots=held_slots_expr(),
            waiting_count=waiting_count_expr(),
            nearest_deadline=Subquery(deadline),
            override_values=Subquery(
                PoolOverride.objects.filter(pool=OuterRef("name")).values("values")[:1],
                output_field=JSONField(),
            ),
        )
    )


def _heads(per_pool: int) -> dict[int, list[HeadEntry]]:
    ranked = (
        Demand.objects.waiting()
        .annotate(
            rank=Window(
                RowNumber(),
                partition_by=[F("pool_id")],
                order_by=[F("line_round").asc(), F("line_at").asc(), F("entry_id").asc()],
            )
        )
        .filter(rank__lte=per_pool)
        .values_list("pool_id", "entry_id", "slots", "rank")
    )
    rows = list(ranked)
    if not rows:
        return {}
    entries = QueueEntry.objects.in_bulk([r[1] for r in rows])
    heads: dict[int, list[HeadEntry]] = {}
    for pool_id, entry_id, slots, rank in sorted(rows, key=lambda r: (r[0], r[3])):
        e = entries.get(entry_id)
        if e is None:  # settled between the two queries
            continue
        heads.setdefault(pool_id, []).append(
            HeadEntry(
                queue_id=e.queue_id,
                key=e.key,
                task_name=e.task_name,
                priority=e.priority,
                slots=slots,
                position=rank,
                enqueued_at=e.enqueued_at,
                deadline=e.deadline,
                not_before=e.not_before,
                root_id=e.root_id,
            )
        )
    return heads


def load(*, head: int = HEAD) -> list[PoolRow]:
    """Every pool with its occupancy and the head of its line (three queries).

    Raises :class:`django.db.DatabaseError` when the database cannot be read; the card
    turns that into "pool state is unavailable".
    """
    pools = _pools_query()
    heads = _heads(head) if any(p.waiting_count for p in pools) else {}  # type: ignore[attr-defined]
    return [
        PoolRow(
            name=p.name,
            slots=p.slots,
            held=p.held_slots,  # type: ignore[attr-defined]
            waiting=p.waiting_count,  # type: ignore[attr-defined]
            paused=p.paused,
            max_queued=p.max_queued,
            nearest_deadline=p.nearest_deadline,  # type: ignore[attr-defined]
            head=heads.get(p.pk, []),
            pending_slots=p.pending_slots,
            rate=p.rate,
            backoff_until=p.backoff_until,
            overrides=tuple(
                overrides.labels(overrides.detail(p.template, p.override_values))  # type: ignore[attr-defined]
            ),
        )
        for p in pools
    ]


def totals(rows: list[PoolRow]) -> dict[str, int]:
    """Sums over all pools for the card's caption (slots of pools that have a slot limit)."""
    limited = [r for r in rows if not r.unlimited]
    return {
        "pools": len(rows),
        "held": sum(r.held for r in limited),
        "slots": sum(r.slots for r in limited),
        "waiting": sum(r.waiting for r in rows),
        "paused": sum(1 for r in rows if r.paused),
    }


__all__ = ["HEAD", "HeadEntry", "PoolRow", "load", "totals"]
