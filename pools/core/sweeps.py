"""The sweep: the safety net run by celery-beat every few seconds (and by ``pools sweep``).

Idempotent and safe to run on many workers at once: every change goes through
:mod:`pools.core.admission`, whose compare-and-set updates under pool locks make a
second sweeper's work a no-op.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Sum
from django.utils import timezone

from pools import conf
from pools.core import admission, backoffs, dispatch, per_key, settings_sync
from pools.core.locking import locked_pools
from pools.models import Demand, OwedWork, Pool, PoolEvent, QueueEntry, RunBudget
from pools.states import TERMINAL_STATES

logger = logging.getLogger("pools.core.sweeps")

#: Lapsed leases handled per sweep (the next sweep takes the rest).
BATCH = 500
#: A timed reclaim runs this long after the lease end it waits for.
LAPSE_MARGIN = timedelta(milliseconds=20)


@dataclass(frozen=True, kw_only=True)
class SweepReport:
    """What one sweep did."""

    requeued: int
    expired: int
    admitted: int
    pruned: int
    #: Pools whose ``held`` counter disagreed with their holders and was corrected.
    held_fixed: int = 0
    #: Pools deleted: retiring pools (removed from settings) now empty, and idle per-key
    #: pools (``POOLS['TEMPLATE_IDLE_SECONDS']``).
    retired: tuple[str, ...] = ()


def sweep(now: datetime | None = None) -> SweepReport:
    """Recover lapsed leases, expire deadlines, run admission everywhere, prune old rows,
    delete retiring pools that are empty and idle per-key pools.

    A lease that will lapse before the next sweep gets a timed wake-up at its lapse
    (``pools.admit``, which reclaims first), so a dead node's slots come back when its
    lease ends, not up to one sweep interval later.
    """
    now = now or timezone.now()
    held_fixed = check_held()
    requeued = reclaim(now)
    expired = admission.expire_due(now)
    admission.note_due_entries()  # entries of a caller that died right after its commit
    backoffs.end_due(now)  # pools whose backoff ended (a restart lost its wake-up)
    admitted = len(admission.admit_all())
    report = SweepReport(
        requeued=requeued,
        expired=expired,
        admitted=admitted,
        pruned=prune(now),
        held_fixed=held_fixed,
        retired=(*settings_sync.sweep_retiring(), *per_key.retire_idle(now)),
    )
    wake_at_next_lapse(now)
    return report


def _held_sums(pool_ids: list[int] | None = None) -> dict[int, int]:
    """What each pool's ``held`` should be: its holders' slots, plus releases still owed
    to its lock holder (settles that found the pool locked: :class:`OwedWork`)."""
    sums: dict[int, int] = {}
    for rows in (Demand.objects.held(), OwedWork.objects.all()):
        if pool_ids is not None:
            rows = rows.filter(pool_id__in=pool_ids)
        for r in rows.values("pool_id").annotate(n=Sum("slots")).order_by():
            sums[r["pool_id"]] = sums.get(r["pool_id"], 0) + int(r["n"] or 0)
    return sums


def check_held() -> int:
    """Check every pool's ``held`` counter against the slots of its holders; returns fixes.

    Admission and settle keep the counter under the pool's row lock, so it never differs
    unless rows were changed around the service functions (by hand, a restored backup).
    A pool that looks wrong without the lock is re-checked with it and corrected: a
    counter below its holders would let admission oversubscribe the pool.
    """
    sums = _held_sums()
    suspects = [
        name
        for pk, name, held in Pool.objects.values_list("pk", "name", "held")
        if held != sums.get(pk, 0)
    ]
    fixed = 0
    for name in suspects:
        with locked_pools([name]) as pools:
            pool = pools.get(name)
            if pool is None:
                continue
            actual = _held_sums([pool.pk]).get(pool.pk, 0)
            if pool.held != actual:
                logger.warning(
                    "pool %r: held counter was %s, its holders hold %s; corrected",
                    name,
                    pool.held,
                    actual,
                )
                Pool.objects.filter(pk=pool.pk).update(held=actual)
                fixed += 1
    return fixed


def reclaim(now: datetime) -> int:
    """Put entries whose lease lapsed before ``now`` back in line; returns how many.

    A lease counts as lapsed ``REQUEUE_GRACE_SECONDS`` after its end: the holder's keeper
    has interrupted the body by its end (on its own clock), the grace covers the skew
    between that clock and this process's (the timing rule in ``docs/concepts/leases.md``).
    """
    now = now - grace()
    requeued = 0
    # Oldest lapse first, in a fixed order: each requeue runs a pass that may expire dead
    # heads, so the order decides what the sweep reports (and the paths must agree).
    lapsed = (
        QueueEntry.objects.lapsed(now)
        .order_by("lease_expires_at", "queue_id")
        .values_list("queue_id", "token")[:BATCH]
    )
    for queue_id, token in list(lapsed):
        if admission.requeue(queue_id, token, reason="lease lapsed", lapsed_before=now):
            requeued += 1
    return requeued


def grace() -> timedelta:
    """How long after its end a lease counts as lapsed (``REQUEUE_GRACE_SECONDS``)."""
    return timedelta(seconds=conf.get().REQUEUE_GRACE_SECONDS)


def wake_at_next_lapse(now: datetime) -> datetime | None:
    """Schedule a reclaim at the earliest lease lapse (end + grace) before the next sweep;
    returns its time."""
    horizon = now + timedelta(seconds=conf.get().SWEEP_SECONDS) - grace()
    first = (
        QueueEntry.objects.held()
        .filter(lease_expires_at__lt=horizon)
        .order_by("lease_expires_at")
        .values_list("lease_expires_at", "demand")
        .first()
    )
    if first is None:
        return None
    when: datetime = first[0] + grace() + LAPSE_MARGIN
    dispatch.wake(sorted(first[1]), when)
    return when


def prune(now: datetime) -> int:
    """Delete finished entries and events older than ``RETENTION_SECONDS``, and the
    budgets (with their charges) of runs opened before then that have no unfinished entry."""
    cutoff = now - timedelta(seconds=conf.get().RETENTION_SECONDS)
    old = QueueEntry.objects.filter(state__in=TERMINAL_STATES, finished_at__lt=cutoff)
    ids = list(old.values_list("queue_id", flat=True)[:BATCH])
    deleted = 0
    if ids:
        deleted = QueueEntry.objects.filter(pk__in=ids).delete()[1].get("pools.QueueEntry", 0)
    PoolEvent.objects.filter(at__lt=cutoff).delete()
    _prune_run_budgets(cutoff)
    return deleted


def _prune_run_budgets(cutoff: datetime) -> None:
    """Budgets of old runs with nothing left to run (a run's id is its entries' ``root_id``,
    or the key of a first task stored without one)."""
    unfinished = QueueEntry.objects.exclude(state__in=TERMINAL_STATES)
    old = (
        RunBudget.objects.filter(created_at__lt=cutoff)
        .exclude(root_id__in=unfinished.filter(root_id__gt="").values("root_id"))
        .exclude(root_id__in=unfinished.filter(root_id="").values("key"))
    )
    ids = list(old.values_list("pk", flat=True)[:BATCH])
    if ids:
        RunBudget.objects.filter(pk__in=ids).delete()
