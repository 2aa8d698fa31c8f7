"""Places in a pool's line and when an entry may start: positions and the ETA.

Read-only, no locks (point-in-time views, like :mod:`pools.core.explain`, which reads
them, and the pool views of :mod:`pools.core.snapshots`).

**Position** is the 1-based place of an entry in a pool's line, the pool's demand rows in
state ``waiting`` in admission order ``(line_round, line_at, entry)``. It is counted
(``COUNT`` of the rows ahead, a range of the ``pools_demand_line`` index), never by loading
the line.

**ETA** (:func:`estimate_eta`): ``now + mean_hold * ceil(position / capacity)``, where
``mean_hold`` is the mean time from admission to finish of the pool's last
:data:`HOLD_SAMPLE` entries that finished within :data:`HOLD_WINDOW`. Each "wave" of
``capacity`` entries ahead is assumed to hold the pool for one mean hold. ``None`` without
such history.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta

from django.db.models import Count, Q

from pools.models import Demand, Pool, QueueEntry
from pools.states import TERMINAL_STATES

#: How many recent holds the ETA averages over, per pool.
HOLD_SAMPLE = 50


#: Only holds that finished this recently count for the ETA.
HOLD_WINDOW = timedelta(hours=1)


def capacity(pool: Pool) -> int:
    """Slots in effect for admission (the old capacity while a capacity change drains)."""
    return pool.slots


def configured(pool: Pool) -> int:
    """The capacity last asked for: the pending one while the pool drains, else ``slots``."""
    return pool.slots if pool.pending_slots is None else pool.pending_slots


def _ahead_q(line_round: int, line_at: datetime, entry_id: int) -> Q:
    """Line rows strictly ahead of a row with these ordering columns (admission order)."""
    return (
        Q(line_round__lt=line_round)
        | Q(line_round=line_round, line_at__lt=line_at)
        | Q(line_round=line_round, line_at=line_at, entry_id__lt=entry_id)
    )


def line_order(d: Demand) -> tuple[int, datetime, int]:
    """Sort key of a demand row in admission order (its place, set by the pool's strategy)."""
    return (d.line_round, d.line_at, d.entry_id)


def position_of(d: Demand) -> int:
    """1-based place of a waiting demand row in its pool's line (one ``COUNT`` query)."""
    ahead = (
        Demand.objects.line(d.pool_id)
        .filter(_ahead_q(d.line_round, d.line_at, d.entry_id))
        .order_by()
        .count()
    )
    return ahead + 1


def positions(pool: Pool, entries: Iterable[QueueEntry | int]) -> dict[int, int]:
    """Places in ``pool``'s line of the given entries (queue id → position), in two queries.

    Entries not in the line are left out. One query reads their demand rows, one counts
    the rows ahead of each of them (conditional counts over the rows ahead of the last).
    """
    ids = [e if isinstance(e, int) else e.queue_id for e in entries]
    if not ids:
        return {}
    rows = sorted(Demand.objects.line(pool.pk).filter(entry_id__in=ids).order_by(), key=line_order)
    if not rows:
        return {}
    last = rows[-1]
    counts = (
        Demand.objects.line(pool.pk)
        .filter(_ahead_q(last.line_round, last.line_at, last.entry_id))
        .order_by()
        .aggregate(
            **{
                f"p{i}": Count("pk", filter=_ahead_q(d.line_round, d.line_at, d.entry_id))
                for i, d in enumerate(rows)
            }
        )
    )
    return {d.entry_id: int(counts[f"p{i}"] or 0) + 1 for i, d in enumerate(rows)}


def hold_times(pool_ids: Sequence[int], now: datetime) -> dict[int, list[timedelta]]:
    """Recent hold times (admitted → finished) per pool, newest first, in one query.

    At most :data:`HOLD_SAMPLE` per pool, from holds that finished within :data:`HOLD_WINDOW`.
    """
    if not pool_ids:
        return {}
    rows = (
        Demand.objects.filter(
            pool_id__in=list(pool_ids),
            state__in=TERMINAL_STATES,
            entry__finished_at__gte=now - HOLD_WINDOW,
            entry__admitted_at__isnull=False,
        )
        .order_by("-entry__finished_at")
        .values_list("pool_id", "entry__admitted_at", "entry__finished_at")[
            : HOLD_SAMPLE * len(pool_ids)
        ]
    )
    out: dict[int, list[timedelta]] = {}
    for pool_id, admitted_at, finished_at in rows:
        sample = out.setdefault(pool_id, [])
        if len(sample) < HOLD_SAMPLE and finished_at and admitted_at and finished_at >= admitted_at:
            sample.append(finished_at - admitted_at)
    return out


def mean_hold(sample: Sequence[timedelta]) -> timedelta | None:
    """Mean of a sample of hold times; ``None`` for an empty sample."""
    if not sample:
        return None
    return sum(sample, timedelta()) / len(sample)


def eta_from(
    hold: timedelta | None, cap: int, position: int | None, now: datetime
) -> datetime | None:
    """``now + hold * ceil(position / cap)``; ``None`` without a mean hold or a position."""
    if hold is None or position is None or cap <= 0:
        return None
    return now + hold * math.ceil(position / cap)


def estimate_eta(pool: Pool, position: int | None, now: datetime) -> datetime | None:
    """Estimated admission time of the entry at ``position`` in ``pool`` (one query)."""
    if position is None:
        return None
    sample = hold_times([pool.pk], now).get(pool.pk, [])
    return eta_from(mean_hold(sample), capacity(pool), position, now)
