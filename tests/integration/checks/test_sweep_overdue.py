"""``pools.W060`` and ``pools list``: celery beat has not sent the sweep lately."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.management import call_command
from django.utils import timezone
from django_celery_beat.models import PeriodicTask

from pools import checks, conf
from pools.celery import beat
from tests.support.factories import make_pool

pytestmark = pytest.mark.django_db


def _sweep_task() -> PeriodicTask:
    assert beat.ensure_sweep_schedule()
    return PeriodicTask.objects.get(name=beat.SWEEP_TASK_NAME)


def _ids() -> list[str | None]:
    return [m.id for m in checks.check_schema(databases=["default"])]


def test_sweep_overdue__silent_while_beat_sends_it_and_right_after_migrate() -> None:
    task = _sweep_task()
    assert beat.sweep_overdue() is None  # registered just now, never sent: not overdue yet
    task.last_run_at = timezone.now() - timedelta(seconds=60)
    task.save()
    assert beat.sweep_overdue() is None
    assert "pools.W060" not in _ids()


def test_sweep_overdue__warns_when_beat_has_not_sent_it(capsys: pytest.CaptureFixture[str]) -> None:
    task = _sweep_task()
    PeriodicTask.objects.filter(pk=task.pk).update(last_run_at=timezone.now() - timedelta(hours=2))
    overdue = beat.sweep_overdue()
    assert overdue is not None and "last sent" in overdue and "for 7200 s" in overdue
    assert "pools.W060" in _ids()
    make_pool("warehouse", 2)
    call_command("pools", "list")
    out = capsys.readouterr().out
    assert "warehouse" in out and "warning: celery beat has not sent the pools sweep" in out


def test_sweep_overdue__never_sent_since_registered_long_ago() -> None:
    task = _sweep_task()
    later = task.date_changed + timedelta(
        seconds=3 * conf.get().SWEEP_SECONDS + beat.SCHEDULER_SYNC_SECONDS + 1
    )
    overdue = beat.sweep_overdue(now=later)
    assert overdue is not None and "never sent since it was registered" in overdue


def test_sweep_overdue__nothing_to_say_when_disabled_or_in_the_projects_own_schedule() -> None:
    task = _sweep_task()
    old = timezone.now() - timedelta(days=1)
    PeriodicTask.objects.filter(pk=task.pk).update(last_run_at=old, enabled=False)
    assert beat.sweep_overdue() is None
    PeriodicTask.objects.filter(pk=task.pk).delete()
    assert beat.sweep_overdue() is None
