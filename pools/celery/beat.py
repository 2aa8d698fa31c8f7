"""django-celery-beat glue: the sweep's periodic task (on ``migrate``), and waiting fires
of a periodic task that is changed, disabled or deleted are cancelled (see
docs/howto/scheduling-with-beat.md).

A change is observed two ways: the model signals of ``PeriodicTask`` (admin, REST, code
that saves the model; the previous values are read in ``pre_save``), and the sweep, as the
safety net for changes made by raw SQL or another process without signals
(:func:`cancel_stale_fires`). The reason is recorded on each cancelled entry.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from django.apps import apps
from django.db.models.signals import post_delete, post_save, pre_save
from django.utils import timezone

from pools import conf
from pools.core import admission
from pools.models import QueueEntry
from pools.states import EntryState, Origin

logger = logging.getLogger("pools.celery.beat")

#: Origins of the entries a periodic task's change cancels: its fires and manual starts.
FIRE_ORIGINS = (Origin.BEAT, Origin.MANUAL)
#: Fields of ``PeriodicTask`` whose change cancels the waiting fires ("schedule" = the
#: schedule foreign keys).
WATCHED = {
    "task": "task",
    "args": "args",
    "kwargs": "kwargs",
    "interval_id": "schedule",
    "crontab_id": "schedule",
    "solar_id": "schedule",
    "clocked_id": "schedule",
}
#: Attribute holding a saved instance's previous values between pre_save and post_save.
_BEFORE = "_pools_before"
#: Waiting fires the sweep checks per run (the next run checks the rest).
SWEEP_BATCH = 500

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


#: django-celery-beat's DatabaseScheduler writes ``last_run_at`` when it syncs, every
#: 3 minutes (Celery's ``Scheduler.sync_every``), so a sent sweep can look this much older.
SCHEDULER_SYNC_SECONDS = 180.0


def sweep_overdue(now: datetime | None = None) -> str | None:
    """A sentence when celery beat has not sent the sweep for a while, else None.

    Read from the periodic task that ``migrate`` registers: its ``last_run_at`` (written by
    the DatabaseScheduler that sends it), or its last change when it never ran. Overdue
    after three sweep periods plus the scheduler's sync interval. None when there is
    nothing to say: django-celery-beat is not installed, the task is not registered (the
    sweep is in the project's own ``beat_schedule``, see ``pools.W002``) or it is disabled
    on purpose.
    """
    if not apps.is_installed("django_celery_beat"):
        return None
    from django_celery_beat.models import PeriodicTask

    task = PeriodicTask.objects.filter(name=SWEEP_TASK_NAME, enabled=True).first()
    if task is None:
        return None
    now = now or timezone.now()
    since = task.last_run_at or task.date_changed
    allowed = timedelta(seconds=3 * conf.get().SWEEP_SECONDS + SCHEDULER_SYNC_SECONDS)
    if since is None or now - since <= allowed:
        return None
    ago = int((now - since).total_seconds())
    what = "last sent" if task.last_run_at else "never sent since it was registered"
    return (
        f"celery beat has not sent the pools sweep for {ago} s ({what}, "
        f"{since:%Y-%m-%d %H:%M:%S %Z}): lapsed leases are not given back, queue_timeout "
        "deadlines do not expire and old entries are not pruned"
    )


def cancel_fires(job: str, reason: str, *, ids: Sequence[int] | None = None) -> int:
    """Cancel the waiting fires (and manual starts) of periodic task ``job``."""
    count = admission.end_waiting_of_job(
        job, state=EntryState.CANCELLED, reason=reason, origins=FIRE_ORIGINS, ids=ids
    )
    if count:
        logger.info(
            "Cancelled %s waiting entr%s of job %s: %s",
            count,
            "y" if count == 1 else "ies",
            job,
            reason,
        )
    return count


def changed_fields(before: dict[str, Any], after: Any) -> list[str]:
    """What changed among :data:`WATCHED` (``task``, ``args``, ``kwargs``, ``schedule``)."""
    changed: list[str] = []
    for field, label in WATCHED.items():
        old, new = before.get(field), getattr(after, field, None)
        if field in ("args", "kwargs"):
            old, new = _json_or_text(old), _json_or_text(new)
        if old != new and label not in changed:
            changed.append(label)
    return changed


def _json_or_text(value: Any) -> Any:
    if not isinstance(value, str) or not value.strip():
        return value or None
    try:
        return json.loads(value)
    except ValueError:
        return value


def _remember(sender: Any, instance: Any, raw: bool = False, **kwargs: Any) -> None:
    """pre_save: keep the stored values the save is about to overwrite."""
    if raw or instance.pk is None:
        return
    fields = ["name", "enabled", "one_off", *WATCHED]
    before = type(instance)._default_manager.filter(pk=instance.pk).values(*fields).first()
    setattr(instance, _BEFORE, before)


def _on_save(sender: Any, instance: Any, created: bool = False, **kwargs: Any) -> None:
    """post_save: a changed, disabled or renamed periodic task cancels its waiting fires."""
    before = instance.__dict__.pop(_BEFORE, None)
    if created or not before:
        return
    old_name = before["name"]
    if old_name != instance.name:
        cancel_fires(old_name, f"periodic task renamed to {instance.name}")
    changed = changed_fields(before, instance)
    if changed:
        cancel_fires(instance.name, f"periodic task changed: {', '.join(changed)}")
    # django-celery-beat disables a one-off task itself once it has run: not a change.
    if before["enabled"] and not instance.enabled and not instance.one_off:
        cancel_fires(instance.name, "periodic task disabled")


def _on_delete(sender: Any, instance: Any, **kwargs: Any) -> None:
    """post_delete: a deleted periodic task cancels its waiting fires."""
    cancel_fires(instance.name, "periodic task deleted")


def connect_signals() -> bool:
    """Watch ``PeriodicTask`` (at app ready); False when django-celery-beat is not installed."""
    if not apps.is_installed("django_celery_beat"):
        return False
    from django_celery_beat.models import PeriodicTask

    pre_save.connect(_remember, sender=PeriodicTask, dispatch_uid="pools.beat.remember")
    post_save.connect(_on_save, sender=PeriodicTask, dispatch_uid="pools.beat.saved")
    post_delete.connect(_on_delete, sender=PeriodicTask, dispatch_uid="pools.beat.deleted")
    return True


def cancel_stale_fires() -> int:
    """Sweep: cancel waiting fires whose periodic task is gone, disabled or now differs.

    The safety net for changes the signals did not see (raw SQL, another process without
    this app). It compares what the entries hold (task name, args, kwargs) with the
    periodic task; a schedule changed behind the ORM's back is not visible in the entries.
    """
    if not apps.is_installed("django_celery_beat"):
        return 0
    from django_celery_beat.models import PeriodicTask

    rows = list(
        QueueEntry.objects.filter(
            finished_at__isnull=True, state=EntryState.WAITING, origin__in=list(FIRE_ORIGINS)
        )
        .exclude(job="")
        .order_by("queue_id")
        .values_list("queue_id", "job", "task_name", "args", "kwargs")[:SWEEP_BATCH]
    )
    if not rows:
        return 0
    tasks = {t.name: t for t in PeriodicTask.objects.filter(name__in={r[1] for r in rows})}
    stale: dict[tuple[str, str], list[int]] = {}
    for queue_id, job, task_name, args, kwargs in rows:
        reason = _stale_reason(tasks.get(job), task_name, args, kwargs)
        if reason:
            stale.setdefault((job, reason), []).append(queue_id)
    return sum(cancel_fires(job, reason, ids=ids) for (job, reason), ids in stale.items())


def _stale_reason(task: Any, task_name: str, args: Any, kwargs: Any) -> str:
    if task is None:
        return "periodic task deleted"
    if not task.enabled and not task.one_off:
        return "periodic task disabled"
    changed = []
    if task.task != task_name:
        changed.append("task")
    # Entries show plain JSON arguments as lists / dicts (else Celery's repr: not compared).
    if isinstance(args, list) and (_json_or_text(task.args) or []) != args:
        changed.append("args")
    if isinstance(kwargs, dict) and (_json_or_text(task.kwargs) or {}) != kwargs:
        changed.append("kwargs")
    return f"periodic task changed: {', '.join(changed)}" if changed else ""
