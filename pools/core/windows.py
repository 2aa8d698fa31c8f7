"""Rate windows during one admission pass: the ring check and the marks it writes.

The rule and the design are in :mod:`pools.core.rates`. This module reads and writes
:class:`~pools.models.RateMark` rows of pools whose row locks the caller holds (the
admission pass, :mod:`pools.core.admission`); it takes no lock itself. The explain
view (:func:`next_opening`) reads them without a lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta

from django.db import connection
from django.db.models import Q
from django.utils import timezone

from pools.core import rated_pools, rates
from pools.models import Pool, QueueEntry, RateMark

#: Marks read per query when the pass needs the next slots of a ring.
CHUNK = 64
#: :meth:`Windows.room` of a pool without a rate.
UNBOUNDED = 2**31


class Windows:
    """The rate windows of the locked pools of one admission pass.

    ``room`` says whether an entry may be admitted now by every rate of its pools;
    ``take`` counts its admission (the next number of each of its rated pools);
    ``write`` stores the marks of the pass's admissions, before the pools' ``admissions``
    counters move on. No query at all when no locked pool has a rate.
    """

    def __init__(self, pools: Mapping[str, Pool]) -> None:
        self.rates = {
            name: rates.parse_rates(pool.rate) for name, pool in pools.items() if pool.rate
        }
        self.pools = pools
        #: Admissions counted in this pass, per rated pool.
        self.taken: dict[str, int] = {}
        self._marks: dict[tuple[str, int], dict[int, datetime | None]] = {}
        self._now: datetime | None = None
        self._offset = timedelta(0)

    @property
    def now(self) -> datetime:
        """The database clock, read once per pass (after the locks: the caller holds them)."""
        if self._now is None:
            self._now = rates.db_now()
            self._offset = timezone.now() - self._now
        return self._now

    def local(self, when: datetime) -> datetime:
        """``when`` (database clock) on this process's clock (for wake-ups)."""
        return when + self._offset

    def _mark(self, name: str, index: int, count: int, slot: int) -> datetime | None:
        cache = self._marks.setdefault((name, index), {})
        if slot not in cache:
            # The next slots of the ring, as one or two ranges (it wraps at ``count``):
            # an index range scan, and no list of numbers to send.
            size = min(count, CHUNK)
            for i in range(size):
                cache.setdefault((slot + i) % count, None)
            end = slot + size
            where = Q(slot__gte=slot, slot__lt=min(end, count))
            if end > count:
                where |= Q(slot__lt=end - count)
            rows = RateMark.objects.filter(
                where, pool_id=self.pools[name].pk, rate_index=index
            ).values_list("slot", "at")
            cache.update(dict(rows))
        return cache[slot]

    def opens_at(self, name: str) -> datetime | None:
        """When pool ``name`` may admit its next entry (database clock); ``None``: now."""
        if name not in self.rates:
            return None
        number = self.pools[name].admissions + self.taken.get(name, 0)
        taken = self.taken.get(name, 0)
        latest: datetime | None = None
        for index, rate in enumerate(self.rates[name]):
            if taken >= rate.count:
                opens = self.now + rate.window  # the N-th previous admission is this pass's
            else:
                at = self._mark(name, index, rate.count, number % rate.count)
                if at is None or at <= self.now - rate.window:
                    continue
                opens = at + rate.window
            latest = opens if latest is None or opens > latest else latest
        return latest

    def room(self, name: str) -> int:
        """At most how many more entries pool ``name`` may admit in this pass by its rates
        (at least 1: a closed window still reads its head, for the wake-up)."""
        if name not in self.rates or self.opens_at(name) is not None:
            return 1 if name in self.rates else UNBOUNDED
        taken = self.taken.get(name, 0)
        return max(1, min(rate.count - taken for rate in self.rates[name]))

    def blocked(self, entry: QueueEntry) -> dict[str, datetime]:
        """The rated pools of ``entry`` without room now, with when each opens (db clock)."""
        out = {}
        for name in entry.demand:
            opens = self.opens_at(name)
            if opens is not None:
                out[name] = opens
        return out

    def take(self, entry: QueueEntry) -> None:
        """Count ``entry``'s admission in each of its rated pools."""
        for name in entry.demand:
            if name in self.rates:
                self.taken[name] = self.taken.get(name, 0) + 1

    def write(self) -> None:
        """Store the marks of this pass's admissions (before ``admissions`` moves on)."""
        rows = []
        for name, taken in self.taken.items():
            first = self.pools[name].admissions
            for index, rate in enumerate(self.rates[name]):
                # Only the last N numbers matter: earlier ones would be overwritten.
                for number in range(first + max(0, taken - rate.count), first + taken):
                    rows.append(
                        RateMark(
                            pool_id=self.pools[name].pk,
                            rate_index=index,
                            slot=number % rate.count,
                            at=self.now,
                        )
                    )
        write_marks(rows)


def write_marks(rows: list[RateMark]) -> None:
    """Write ring slots (of admissions or of starts): an upsert, each slot's row overwritten
    (MariaDB/MySQL name no conflict target). The caller holds the pools' locks."""
    if not rows:
        return
    target = (
        ["pool", "rate_index", "slot"]
        if connection.features.supports_update_conflicts_with_target
        else None
    )
    RateMark.objects.bulk_create(
        rows, update_conflicts=True, update_fields=["at"], unique_fields=target
    )


def reset(pool: Pool) -> None:
    """Forget the pool's windows of admissions and of starts (its rates changed; the
    caller holds its lock)."""
    RateMark.objects.filter(pool_id=pool.pk).delete()
    rated_pools.forget()


def next_opening(pool: Pool, ahead: int = 0) -> datetime | None:
    """When pool ``pool`` may admit the entry with ``ahead`` admissions before it, by its
    rates alone (database clock); ``None`` when its rates leave room now (or it has none).

    Exact for ``ahead < N`` from the marks; beyond, admission ``j`` comes at least ``W``
    after admission ``j - N``. Read without a lock (explain).
    """
    if not pool.rate:
        return None
    now = rates.db_now()
    latest: datetime | None = None
    for index, rate in enumerate(rates.parse_rates(pool.rate)):
        laps, first = divmod(ahead, rate.count)
        slot = (pool.admissions + first) % rate.count
        at = (
            RateMark.objects.filter(pool_id=pool.pk, rate_index=index, slot=slot)
            .values_list("at", flat=True)
            .first()
        )
        opens = max(now, at + rate.window) if at is not None else now
        opens += laps * rate.window
        if opens > now and (latest is None or opens > latest):
            latest = opens
    return latest


def to_local(when: datetime) -> datetime:
    """A database-clock time on this process's clock (one extra clock read)."""
    return when + (timezone.now() - rates.db_now())


def has_rates(pools: Iterable[Pool]) -> bool:
    """True if any of ``pools`` has a rate."""
    return any(p.rate for p in pools)
