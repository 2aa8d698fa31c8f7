"""Celery tasks shipped with the app (found by ``app.autodiscover_tasks()``)."""

from __future__ import annotations

from celery import shared_task
from django.utils import timezone

from pools.celery import beat
from pools.core import admission, locking, sweeps


@shared_task(name="pools.sweep", ignore_result=True)
def sweep() -> dict[str, int]:
    """One sweep pass; scheduled by celery-beat every ``POOLS['SWEEP_SECONDS']``."""
    locking.drop_broken_connection()  # after a database restart: a pool process keeps its connection
    report = sweeps.sweep()
    cancelled = beat.cancel_stale_fires()  # periodic tasks changed behind the signals' back
    return {
        "cancelled": cancelled,
        "requeued": report.requeued,
        "expired": report.expired,
        "admitted": report.admitted,
        "pruned": report.pruned,
        "retired": len(report.retired),
    }


@shared_task(name="pools.admit", ignore_result=True)
def admit(pools: list[str]) -> int:
    """Timed wake-up: reclaim lapsed leases, then run admission over ``pools``.

    Sent for a head whose ``not_before`` arrives and for a lease about to lapse. Every
    process that saw such a time sends its own; on PostgreSQL the pass does not queue
    behind a process holding the pools' locks, it is left to that process
    (:func:`pools.core.admission.wake`).
    """
    locking.drop_broken_connection()
    sweeps.reclaim(timezone.now())
    return len(admission.wake(pools))
