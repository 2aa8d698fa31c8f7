"""The sweep: the safety net run by celery-beat every few seconds (and by ``pools sweep``).

Idempotent and safe to run on many workers at once: every change goes through
:mod:`pools.core.admission`, whose compare-and-set updates under pool locks make a
second sweeper's work a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.utils import timezone

from pools import conf
from pools.core import admission, dispatch
from pools.models import TERMINAL_STATES, PoolEvent, QueueEntry

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


def sweep(now: datetime | None = None) -> SweepReport:
    """Recover lapsed leases, expire deadlines, run admission everywhere, prune old rows.

    A lease that will lapse before the next sweep gets a timed wake-up at its lapse
    (``pools.admit``, which reclaims first), so a dead node's slots come back when its
    lease ends, not up to one sweep interval later.
    """
    now = now or timezone.now()
    requeued = reclaim(now)
    expired = admission.expire_due(now)
    admitted = len(admission.admit_all())
    report = SweepReport(requeued=requeued, expired=expired, admitted=admitted, pruned=prune(now))
    wake_at_next_lapse(now)
    return report


def reclaim(now: datetime) -> int:
    """Put entries whose lease lapsed before ``now`` back in line; returns how many."""
    requeued = 0
    lapsed = QueueEntry.objects.lapsed(now).values_list("queue_id", "token")[:BATCH]
    for queue_id, token in list(lapsed):
        if admission.requeue(queue_id, token, reason="lease lapsed", lapsed_before=now):
            requeued += 1
    return requeued


def wake_at_next_lapse(now: datetime) -> datetime | None:
    """Schedule a reclaim at the earliest lease end before the next sweep; returns its time."""
    horizon = now + timedelta(seconds=conf.get().SWEEP_SECONDS)
    first = (
        QueueEntry.objects.held()
        .filter(lease_expires_at__lt=horizon)
        .order_by("lease_expires_at")
        .values_list("lease_expires_at", "demand")
        .first()
    )
    if first is None:
        return None
    when: datetime = first[0] + LAPSE_MARGIN
    dispatch.wake(sorted(first[1]), when)
    return when


def prune(now: datetime) -> int:
    """Delete finished entries and events older than ``RETENTION_SECONDS``."""
    cutoff = now - timedelta(seconds=conf.get().RETENTION_SECONDS)
    old = QueueEntry.objects.filter(state__in=TERMINAL_STATES, finished_at__lt=cutoff)
    ids = list(old.values_list("queue_id", flat=True)[:BATCH])
    deleted = 0
    if ids:
        deleted = QueueEntry.objects.filter(pk__in=ids).delete()[1].get("pools.QueueEntry", 0)
    PoolEvent.objects.filter(at__lt=cutoff).delete()
    return deleted
