"""The sweep: the safety net run by celery-beat every few seconds (and by ``pools sweep``).

Idempotent and safe to run on many workers at once: every change goes through
:mod:`pools.admission`, whose compare-and-set updates under pool locks make a
second sweeper's work a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.utils import timezone

from pools import admission, conf
from pools.models import TERMINAL_STATES, PoolEvent, QueueEntry

#: Lapsed leases handled per sweep (the next sweep takes the rest).
BATCH = 500


@dataclass(frozen=True, kw_only=True)
class SweepReport:
    """What one sweep did."""

    requeued: int
    expired: int
    admitted: int
    pruned: int


def sweep(now: datetime | None = None) -> SweepReport:
    """Recover lapsed leases, expire deadlines, run admission everywhere, prune old rows."""
    now = now or timezone.now()
    requeued = 0
    lapsed = QueueEntry.objects.lapsed(now).values_list("queue_id", "token")[:BATCH]
    for queue_id, token in list(lapsed):
        if admission.requeue(queue_id, token, reason="lease lapsed", lapsed_before=now):
            requeued += 1
    expired = admission.expire_due(now)
    admitted = len(admission.admit_all())
    return SweepReport(requeued=requeued, expired=expired, admitted=admitted, pruned=prune(now))


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
