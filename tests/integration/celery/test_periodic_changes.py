"""A periodic task that is changed, disabled or deleted cancels its waiting fires (SPEC §7):
observed by the model signals, and by the sweep for changes made behind them (raw SQL)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.db import connection
from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask

from pools.celery import beat
from pools.models import QueueEntry
from pools.states import EntryState
from tests.conftest import POOL_APPS
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool
from tests.testapp.tasks import add, tsum

pytestmark = pytest.mark.django_db(transaction=True, available_apps=POOL_APPS)


@pytest.fixture
def paths(admission_path: str, recorder: RecordingBridge) -> RecordingBridge:
    return recorder


def periodic(name: str = "nightly", **kw: Any) -> PeriodicTask:
    every, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.HOURS)
    defaults: dict[str, Any] = {"task": add.name, "args": json.dumps([1, 2])}
    return PeriodicTask.objects.create(name=name, interval=every, **{**defaults, **kw})


def fire(name: str = "nightly", args: tuple[int, ...] = (1, 2)) -> str:
    """What beat sends for periodic task ``name``: the warehouse pool is full, so it waits."""
    return str(add.apply_async(args, headers={"periodic_task_name": name}).id)


def state(key: str) -> tuple[str, str]:
    entry = QueueEntry.objects.get(key=key)
    return entry.state, entry.reason


@pytest.fixture
def waiting(paths: RecordingBridge) -> tuple[PeriodicTask, str, str]:
    """A periodic task, its waiting fire, and an unrelated waiting call of the same task."""
    make_pool("warehouse", 1)
    add.delay(0, 0)  # holds the only slot
    task = periodic()
    return task, fire(), str(add.delay(1, 2).id)


CANCELLED = EntryState.CANCELLED


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"args": json.dumps([5, 6])}, "periodic task changed: args"),
        ({"kwargs": json.dumps({"y": 1})}, "periodic task changed: kwargs"),
        ({"task": tsum.name}, "periodic task changed: task"),
        ({"enabled": False}, "periodic task disabled"),
    ],
)
def test_saved_change__cancels_the_waiting_fires_with_the_reason(
    waiting: tuple[PeriodicTask, str, str], change: dict[str, Any], reason: str
) -> None:
    task, fired, other = waiting
    for field, value in change.items():
        setattr(task, field, value)
    task.save()
    assert state(fired) == (CANCELLED, reason)
    assert state(other)[0] == EntryState.WAITING  # not a fire of that periodic task


def test_schedule_change__cancels_the_waiting_fires(waiting: tuple[PeriodicTask, str, str]) -> None:
    task, fired, _ = waiting
    task.interval = None
    task.crontab = CrontabSchedule.objects.create(minute="5")
    task.save()
    assert state(fired) == (CANCELLED, "periodic task changed: schedule")


def test_save_without_a_change__cancels_nothing(waiting: tuple[PeriodicTask, str, str]) -> None:
    task, fired, _ = waiting
    task.description = "documented"
    task.args = json.dumps([1, 2], indent=2)  # the same arguments, spelt differently
    task.total_run_count += 1  # what beat itself saves
    task.save()
    assert state(fired)[0] == EntryState.WAITING


def test_one_off_disabled_by_beat_after_its_run__cancels_nothing(paths: RecordingBridge) -> None:
    make_pool("warehouse", 1)
    add.delay(0, 0)
    task = periodic("once", one_off=True)
    fired = fire("once")
    task.enabled = False
    task.save()
    assert state(fired)[0] == EntryState.WAITING


def test_delete_and_rename__cancel_the_waiting_fires(
    waiting: tuple[PeriodicTask, str, str],
) -> None:
    task, fired, _ = waiting
    task.name = "nightly-v2"
    task.save()
    assert state(fired) == (CANCELLED, "periodic task renamed to nightly-v2")
    again = fire("nightly-v2")
    task.delete()
    assert state(again) == (CANCELLED, "periodic task deleted")


def test_sweep__catches_changes_made_by_raw_sql(waiting: tuple[PeriodicTask, str, str]) -> None:
    task, fired, other = waiting
    current = fire()
    table = PeriodicTask._meta.db_table
    with connection.cursor() as cursor:  # behind the signals' back
        cursor.execute(f"UPDATE {table} SET args = %s WHERE id = %s", ["[7, 8]", task.pk])
    new_args = fire(args=(7, 8))
    assert beat.cancel_stale_fires() == 2
    assert state(fired) == state(current) == (CANCELLED, "periodic task changed: args")
    assert state(new_args)[0] == state(other)[0] == EntryState.WAITING
    with connection.cursor() as cursor:
        cursor.execute(f"DELETE FROM {table} WHERE id = %s", [task.pk])
    assert beat.cancel_stale_fires() == 1
    assert state(new_args) == (CANCELLED, "periodic task deleted")
    assert beat.cancel_stale_fires() == 0


def test_manual_start_of_a_skip_job__returns_the_unfinished_entry_with_the_warning(
    paths: RecordingBridge, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from pools.celery import jobs
    from tests.testapp.tasks import skip_job

    make_pool("warehouse", 1)
    add.delay(0, 0)
    periodic("skipper", task=skip_job.name, args="[]")
    first = jobs.start_job("skipper")
    with caplog.at_level(logging.WARNING, logger="pools"):
        again = jobs.start_job("skipper")
    assert (again.key, again.queue_id, again.existing) == (first.key, first.queue_id, True)
    assert not first.existing
    assert [r.getMessage() for r in caplog.records if r.name == "pools"] == [
        "Job skipper could not enter pool warehouse: skipped: skipper is already waiting"
    ]
