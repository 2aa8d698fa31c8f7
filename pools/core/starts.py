"""Rated starts: a pool's rate ``N/W`` holds for the moments bodies start, across every worker.

Admission reserves a place in the pool's window (its ring of admissions,
:mod:`pools.core.windows`); the worker's start of a rated entry *confirms* it here. Under
the row locks of the entry's pools (:func:`pools.core.locking.locked_pools`: pool rows in
name order, then the entry row), which serialise the rated starts of a pool with each
other and with its admission passes, a start at ``t`` (database clock) is allowed iff for
each rate ``N/W`` of each of its pools the window ``(t - W - margin, t]`` holds fewer than
``N`` starts (:func:`pools.core.rates.start_opens`). Then, in the same transaction, the
entry becomes ``running`` and ``t`` goes into slot ``Pool.starts mod N`` of each rate's
ring of starts (``RateMark`` rows with ``rate_index = START_INDEX + i``), and
``Pool.starts`` moves on. So no window of ``W`` ever holds more than ``N`` confirmed starts,
and the bodies' own start times keep that bound while the hand-off from this call to a
body's first line varies by less than :data:`pools.core.rates.HANDOFF_MARGIN`.

Otherwise the start waits for its place: :func:`start` sleeps and checks again when the
place comes soon (:func:`short_wait`); when it comes later, :func:`postpone` puts the entry
back in line at its place, slots released, with the pool's next admission held until
then, so the same entry is admitted again when its place comes (not a failure).

Only entries admitted in a pool with a rate take this path: the admitting process says so
in the message (:attr:`pools.core.records.Admission.rated`; the PostgreSQL engine's
admissions ask :mod:`pools.core.rated_pools`), so starts of unrated entries
stay one compare-and-set without a pool lock (:mod:`pools.core.leases`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import F
from django.utils import timezone

from pools import conf
from pools.core import rates, settling, windows
from pools.core.locking import locked_pools, unavailable_on_error
from pools.core.records import Claim
from pools.core.running import mark_running
from pools.models import Pool, QueueEntry, RateMark
from pools.states import EntryState

#: Longest a worker sleeps in all before a rated start, at most (see :func:`short_wait`).
SHORT_WAIT_SECONDS = 1.5
#: Reason recorded on an entry put back in line because its start had to wait long.
POSTPONED = "rate: start waits for its window"


@dataclass(frozen=True)
class Postponed:
    """A rated start that must wait for its place in a window."""

    #: When the place comes (database clock).
    until: datetime
    #: Seconds from the check to ``until``.
    seconds: float


def short_wait() -> float:
    """Longest wait a worker sleeps through before a rated start (seconds): a second and a
    half (a per-second window plus its margin), or a tenth of the lease if less (the
    admitted entry's lease keeps running meanwhile)."""
    return min(SHORT_WAIT_SECONDS, conf.get().LEASE_SECONDS / 10)


def start(
    entry_id: int,
    token: int,
    *,
    worker: str,
    attempt: Callable[..., Claim | Postponed | None] | None = None,
) -> Claim | Postponed | None:
    """Start a rated entry: as :func:`pools.core.leases.start`, when its place in each of its
    pools' windows of starts has come; a short wait is slept through here.

    ``Postponed`` when the place comes later than :func:`short_wait`: the entry is then back
    in line (:func:`postpone`) and the delivery must not run. ``None`` as for a stale token.
    ``attempt``: one check (the engine's ``try_start_rated``; default :func:`try_start`).
    """
    check = attempt or try_start
    slept = 0.0
    while True:
        got = check(entry_id, token, worker=worker)
        if not isinstance(got, Postponed):
            return got
        if slept + got.seconds <= short_wait():
            time.sleep(got.seconds)
            slept += got.seconds
            continue
        return got if postpone(entry_id, token, got.until) else None


def try_start(entry_id: int, token: int, *, worker: str) -> Claim | Postponed | None:
    """One check of a rated start under its pools' locks; starts it if its place has come."""
    with unavailable_on_error(f"starting entry {entry_id}"):
        demand = QueueEntry.objects.filter(pk=entry_id).values_list("demand", flat=True).first()
    if demand is None:
        return None
    with locked_pools(demand) as pools:
        rated = {name: rates.parse_rates(p.rate) for name, p in pools.items() if p.rate}
        now = rates.db_now() if rated else timezone.now()
        opens = rates.start_opens(list(_next_slots(pools, rated)), now) if rated else None
        if opens is not None:
            still = QueueEntry.objects.filter(pk=entry_id, token=token, state=EntryState.ADMITTED)
            if not still.exists():
                return None
            return Postponed(until=opens, seconds=(opens - now).total_seconds())
        # The entry's own times stay on this process's clock, as on every start.
        claim = mark_running(entry_id, token, worker=worker, now=timezone.now())
        if claim is not None and rated:
            _count(pools, rated, now)
    return claim


def postpone(entry_id: int, token: int, until: datetime) -> bool:
    """Put an admitted rated entry back in line at its place, its slots released, with its
    pools' next admissions held until ``until`` (database clock) when its place comes;
    False for a stale token. The admission pass then gives it a wake-up for ``until``."""
    return settling.requeue(
        entry_id, token, reason=POSTPONED, unstarted=True, hold=lambda pools: hold(pools, until)
    )


def hold(pools: Mapping[str, Pool], until: datetime) -> None:
    """No admission of the rated ``pools`` before ``until`` (database clock; the caller holds
    their locks): the slot of each rate's ring of admissions that the next admission reads
    gets at least ``until - W``. Only ever later: it never lets an admission through."""
    for pool in pools.values():
        if not pool.rate:
            continue
        for index, rate in enumerate(rates.parse_rates(pool.rate)):
            slot = pool.admissions % rate.count
            at = until - rate.window
            mark = RateMark.objects.filter(pool_id=pool.pk, rate_index=index, slot=slot)
            if not mark.filter(at__gte=at).exists():
                windows.write_marks([RateMark(pool_id=pool.pk, rate_index=index, slot=slot, at=at)])


def _next_slots(
    pools: Mapping[str, Pool], rated: Mapping[str, tuple[rates.Rate, ...]]
) -> Iterable[tuple[rates.Rate, datetime | None]]:
    """Each rate with the time in the slot of its ring of starts the next start writes."""
    for name, pool_rates in rated.items():
        pool = pools[name]
        for index, rate in enumerate(pool_rates):
            at = (
                RateMark.objects.filter(
                    pool_id=pool.pk,
                    rate_index=rates.START_INDEX + index,
                    slot=pool.starts % rate.count,
                )
                .values_list("at", flat=True)
                .first()
            )
            yield rate, at


def _count(
    pools: Mapping[str, Pool], rated: Mapping[str, tuple[rates.Rate, ...]], now: datetime
) -> None:
    """Write this start's marks and move the pools' ``starts`` counters on."""
    rows = [
        RateMark(
            pool_id=pools[name].pk,
            rate_index=rates.START_INDEX + index,
            slot=pools[name].starts % rate.count,
            at=now,
        )
        for name, pool_rates in rated.items()
        for index, rate in enumerate(pool_rates)
    ]
    windows.write_marks(rows)
    Pool.objects.filter(pk__in=[pools[name].pk for name in rated]).update(starts=F("starts") + 1)


def local_until(postponed: Postponed) -> datetime:
    """When a postponed start's place comes, on this process's clock (for logs)."""
    return timezone.now() + timedelta(seconds=postponed.seconds)
