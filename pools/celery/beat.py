"""Registers the sweep as a django-celery-beat periodic task (on ``migrate``)."""

from __future__ import annotations

from django.apps import apps

from pools import conf

SWEEP_TASK_NAME = "pools: sweep"


def ensure_sweep_schedule() -> bool:
    """Create or update the periodic sweep; False when django-celery-beat is not installed."""
    if not apps.is_installed("django_celery_beat"):
        return False
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    seconds = max(1, round(conf.get().SWEEP_SECONDS))
    schedule, _ = IntervalSchedule.objects.get_or_create(
        every=seconds, period=IntervalSchedule.SECONDS
    )
    PeriodicTask.objects.update_or_create(
        name=SWEEP_TASK_NAME,
        defaults={
            "task": "pools.sweep",
            "interval": schedule,
            "enabled": True,
            # A sweep that could not run in time is dropped, never stacked.
            "expire_seconds": seconds,
            "description": "django-celery-pools safety net: lapsed leases, deadlines, admission.",
        },
    )
    return True
