"""Per-pool daily spend caps: slot-seconds per UTC day (``Pool.spend_cap``).

At settle, an attempt that held ``slots`` of a capped pool for ``t`` seconds (admission to
settle) adds ``slots * t`` to the pool's spend of the current UTC day
(``Pool.spent_today`` for ``Pool.spend_day``), under the pool's lock. Once the day's
spend reaches the cap, admission passes admit nothing from the pool (its entries wait and
keep their place; ``blocked_by: "spend_cap"``) until the next UTC day, when a wake-up
runs admission again. Persisted on the pool row, so a restart changes nothing.

The clock is :data:`clock` (``django.utils.timezone.now``); tests replace it with
:func:`pools.testing.spend_clock`. Only the *day* comes from it: the seconds measured are
those of the entries' own timestamps.

Entries already admitted when the cap is reached run to their end (the cap can be
overshot by what was in flight). The PostgreSQL fast path hands capped pools to the
Python pass ('fallback'), which decides with this module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, date, datetime, time, timedelta

from django.utils import timezone

from pools.models import Pool, QueueEntry

#: Where the day comes from (replaceable in tests: :func:`pools.testing.spend_clock`).
clock: Callable[[], datetime] = timezone.now


def today() -> date:
    """The current UTC day by :data:`clock`."""
    return clock().astimezone(UTC).date()


def next_day() -> datetime:
    """When the next UTC day starts, in :data:`clock`'s time line (for wake-ups)."""
    now = clock()
    start = datetime.combine(now.astimezone(UTC).date() + timedelta(days=1), time(), tzinfo=UTC)
    return start


def spent(pool: Pool, day: date | None = None) -> float:
    """Slot-seconds the pool has spent on ``day`` (default: today)."""
    day = day or today()
    return pool.spent_today if pool.spend_day == day else 0.0


def is_capped(pool: Pool, day: date | None = None) -> bool:
    """True when the pool has a cap and has spent it today."""
    return pool.spend_cap is not None and spent(pool, day) >= pool.spend_cap


def add_spend(pools: Mapping[str, Pool], entry: QueueEntry, finished_at: datetime) -> None:
    """Add a settled attempt's slot-seconds to its capped pools (locked by the caller)."""
    if entry.admitted_at is None:
        return
    seconds = max((finished_at - entry.admitted_at).total_seconds(), 0.0)
    day = today()
    for name, slots in entry.demand.items():
        pool = pools.get(name)
        if pool is None or pool.spend_cap is None:
            continue
        pool.spent_today = spent(pool, day) + slots * seconds
        pool.spend_day = day
        Pool.objects.filter(pk=pool.pk).update(
            spent_today=pool.spent_today, spend_day=pool.spend_day
        )


def capped_names(pools: Iterable[Pool]) -> set[str]:
    """Names of the pools that have spent today's cap."""
    day = today()
    return {p.name for p in pools if is_capped(p, day)}
