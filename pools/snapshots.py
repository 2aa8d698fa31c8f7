"""Read-only, point-in-time views of pools for the CLI, admin, REST API and demo."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from pools.exceptions import UnknownPool
from pools.models import Demand, Pool


@dataclass(frozen=True, kw_only=True)
class LineItem:
    """One entry as seen from one pool."""

    queue_id: int
    key: str
    task_name: str
    state: str
    priority: int
    slots: int
    #: 1-based place in the pool's line (waiting entries only).
    position: int | None
    enqueued_at: datetime
    deadline: datetime | None
    lease_expires_at: datetime | None
    worker: str


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

    @property
    def free(self) -> int:
        """Slots not held (never negative)."""
        return max(self.slots - self.held, 0)


def _item(d: Demand, position: int | None) -> LineItem:
    e = d.entry
    return LineItem(
        queue_id=e.queue_id,
        key=e.key,
        task_name=e.task_name,
        state=e.state,
        priority=e.priority,
        slots=d.slots,
        position=position,
        enqueued_at=e.enqueued_at,
        deadline=e.deadline,
        lease_expires_at=e.lease_expires_at,
        worker=e.worker,
    )


def snapshot(name: str, *, head: int = 10) -> PoolSnapshot:
    """Snapshot pool ``name`` with the first ``head`` waiting entries."""
    pool = Pool.objects.filter(name=name).first()
    if pool is None:
        raise UnknownPool(name)
    return _build(pool, head)


def snapshot_all(*, head: int = 5) -> list[PoolSnapshot]:
    """Snapshots of every pool, by name."""
    return [_build(p, head) for p in Pool.objects.order_by("name")]


def _build(pool: Pool, head: int) -> PoolSnapshot:
    holders = list(
        Demand.objects.held().filter(pool=pool).select_related("entry").order_by("entry_id")
    )
    line = list(Demand.objects.line(pool.pk).select_related("entry")[:head])
    return PoolSnapshot(
        name=pool.name,
        slots=pool.slots,
        held=sum(d.slots for d in holders),
        waiting=Demand.objects.waiting().filter(pool=pool).count(),
        paused=pool.paused,
        max_queued=pool.max_queued,
        holders=[_item(d, None) for d in holders],
        head=[_item(d, i + 1) for i, d in enumerate(line)],
    )
