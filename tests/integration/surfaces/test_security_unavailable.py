"""Refused and unreachable pools on every surface.

- A beat fire the pools refuse (full, unknown pool, demand above capacity) or cannot reach
  (pool state unavailable) is dropped with exactly one WARNING on the ``pools`` logger,
  ``Job <name> could not enter pool <pool>: <reason>``, and beat goes on with its other
  jobs. ``<name>`` is the ``periodic_task_name`` header, else the task name.
- A manual start (``start_job``, REST ``POST jobs/<name>/start``, the admin's "Run now")
  logs the same line once and answers the refusal (409) or unavailability (503).
- With the pool table locked past ``LOCK_TIMEOUT_SECONDS`` (PostgreSQL, a second
  connection), REST reads answer 503 ``{"detail": "pool state is unavailable"}`` at the
  bound and the admin card shows the condition instead of hanging or failing.

Beat fires are sent by Celery's own ``Scheduler.apply_entry`` with django-celery-beat's
``ModelEntry`` (the objects a running beat uses), in-process.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from celery.beat import ScheduleEntry, Scheduler
from celery.schedules import schedule
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django_celery_beat.models import IntervalSchedule, PeriodicTask
from django_celery_beat.schedulers import ModelEntry

from pools.celery import jobs
from pools.exceptions import PoolFull, PoolUnavailable
from pools.models import Demand, PoolEvent, QueueEntry
from tests.celery_app import app
from tests.integration.core.test_bad_input import nowhere, wide
from tests.support.admin import ADMIN_APPS
from tests.support.api import ALL_PERMS, client_for, error, url
from tests.support.factories import make_pool, submit
from tests.testapp.tasks import add

pytestmark = pytest.mark.django_db(transaction=True, available_apps=ADMIN_APPS)

UNAVAILABLE = {"detail": "pool state is unavailable"}


def periodic(name: str, task: str, *args: Any) -> PeriodicTask:
    every, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.HOURS)
    return PeriodicTask.objects.create(
        name=name, task=task, interval=every, args=json.dumps(list(args)), enabled=True
    )


def fire(job: PeriodicTask) -> None:
    """Send one beat fire of ``job`` as celery beat does (errors are beat's to log)."""
    Scheduler(app, lazy=True).apply_entry(ModelEntry(job, app=app))


def counts() -> tuple[int, int, int]:
    return QueueEntry.objects.count(), Demand.objects.count(), PoolEvent.objects.count()


@pytest.fixture
def warnings_(caplog) -> Iterator[Any]:
    """Every WARNING-or-worse record of any logger, captured during the test."""
    caplog.set_level(logging.WARNING)
    yield caplog


def pools_warnings(caplog: Any) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "pools"]


def others(caplog: Any) -> list[str]:
    """Warnings of other loggers, except Django's request log of an error answer."""
    return [
        f"{r.name}: {r.getMessage()}"
        for r in caplog.records
        if r.name != "pools" and r.levelno >= logging.WARNING and r.name != "django.request"
    ]


@pytest.fixture
def full(recorder):
    """``warehouse`` (1 slot, max_queued 1): one holder and one waiting, so the line is full."""
    make_pool("warehouse", 1, max_queued=1)
    submit("warehouse", key="holder")
    submit("warehouse", key="waiting")
    return recorder


# --------------------------------------------------------------------------- beat fires


def test_beat_fire__full_pool_is_dropped_with_one_warning(full, warnings_):
    job = periodic("nightly export", add.name, 1, 2)
    before = counts()
    fire(job)
    assert counts() == before
    assert pools_warnings(warnings_) == [
        "Job nightly export could not enter pool warehouse: Pool 'warehouse' is full: it "
        "already has 1 waiting entries (max_queued=1). Retry later, or raise max_queued for "
        "this pool."
    ]
    assert others(warnings_) == []  # no "Message Error" from celery.beat


def test_beat_fire__unknown_pool_is_dropped_and_beat_goes_on(recorder, warnings_):
    make_pool("warehouse", 1)
    dropped = periodic("orphan", nowhere.name)
    fine = periodic("fine", add.name, 3, 4)
    fire(dropped)
    fire(fine)
    (message,) = pools_warnings(warnings_)
    assert message.startswith(
        "Job orphan could not enter pool nowhere-pool: Pool 'nowhere-pool' does not exist."
    )
    assert others(warnings_) == []
    assert list(QueueEntry.objects.values_list("args", flat=True)) == [[3, 4]]  # the next fire


def test_beat_fire__demand_above_capacity_is_dropped(recorder, warnings_):
    make_pool("warehouse", 1)
    fire(periodic("too wide", wide.name))
    assert pools_warnings(warnings_) == [
        "Job too wide could not enter pool warehouse: A task asks for 3 slot(s) of pool "
        "'warehouse', which has only 1: it could never be admitted. Lower the task's slots "
        "or raise the pool's capacity."
    ]
    assert counts() == (0, 0, 0)


def test_beat_fire__without_periodic_task_name_is_named_by_its_task(full, warnings_):
    """A ``beat_schedule`` entry of Celery's own scheduler carries no periodic_task_name."""
    entry = ScheduleEntry(name="conf entry", task=add.name, schedule=schedule(3600), args=(1, 2))
    entry.app = app
    Scheduler(app, lazy=True).apply_entry(entry)
    (message,) = pools_warnings(warnings_)
    assert message.startswith(f"Job {add.name} could not enter pool warehouse: Pool 'warehouse'")


def test_beat_fire__admitted_fire_logs_nothing(recorder, warnings_):
    """The control: a fire the pool takes is queued and warns nothing."""
    make_pool("warehouse", 1)
    fire(periodic("nightly", add.name, 1, 2))
    assert QueueEntry.objects.get().origin == "beat"
    assert warnings_.records == []


# --------------------------------------------------------------------------- manual starts


def test_start_job__refusal_raises_and_logs_one_warning(full, warnings_):
    periodic("nightly", add.name, 1, 2)
    before = counts()
    with pytest.raises(PoolFull):
        jobs.start_job("nightly")
    assert counts() == before
    (message,) = pools_warnings(warnings_)
    assert message.startswith("Job nightly could not enter pool warehouse: Pool 'warehouse' is")
    assert others(warnings_) == []


def test_rest_start__refusal_is_409_with_one_warning(full, warnings_):
    periodic("nightly", add.name, 1, 2)
    status, body = error(client_for(*ALL_PERMS).post(url("jobs/nightly/start")))
    assert (status, body["code"]) == (409, "pool_full")
    assert len(pools_warnings(warnings_)) == 1


def test_admin_run_now__refusal_is_a_message_with_one_warning(full, warnings_):
    job = periodic("nightly", add.name, 1, 2)
    client = Client()
    client.force_login(User.objects.create_superuser("root", password="pw"))
    response = client.post(
        "/admin/django_celery_beat/periodictask/",
        {"action": "run_now", "_selected_action": [str(job.pk)]},
        follow=True,
    )
    assert "Nightly: not started. Pool &#x27;warehouse&#x27; is full" in response.content.decode()
    assert len(pools_warnings(warnings_)) == 1


# --------------------------------------------------------------------------- unavailable


@contextmanager
def table_locked(table: str) -> Iterator[None]:
    """A second connection holding ``LOCK TABLE ... ACCESS EXCLUSIVE`` (reads wait too)."""
    import psycopg

    d = connection.settings_dict
    con = psycopg.connect(dbname=d["NAME"], user=d["USER"], host=d["HOST"], port=d["PORT"])
    try:
        con.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        yield
    finally:
        con.rollback()
        con.close()


@pytest.fixture
def short_bound(settings):
    settings.POOLS = {**settings.POOLS, "LOCK_TIMEOUT_SECONDS": 0.3}


@pytest.mark.postgres
def test_beat_fire__unavailable_is_dropped_with_one_warning(recorder, short_bound, warnings_):
    make_pool("warehouse", 1)
    job = periodic("nightly", add.name, 1, 2)
    with table_locked("pools_pool"):
        fire(job)
    (message,) = pools_warnings(warnings_)
    assert message.startswith("Job nightly could not enter pool warehouse: pool state is unavail")
    assert "\n" not in message
    assert others(warnings_) == []
    assert counts() == (0, 0, 0)
    fire(job)  # the next fire, with the lock gone, is queued
    assert QueueEntry.objects.count() == 1


@pytest.mark.postgres
def test_rest_start__unavailable_is_503_with_one_warning(recorder, short_bound, warnings_):
    make_pool("warehouse", 1)
    periodic("nightly", add.name, 1, 2)
    with table_locked("pools_pool"):
        response = client_for(*ALL_PERMS).post(url("jobs/nightly/start"))
    assert error(response) == (503, UNAVAILABLE)
    (message,) = pools_warnings(warnings_)
    assert message.startswith("Job nightly could not enter pool warehouse: pool state is unavail")
    with pytest.raises(PoolUnavailable), table_locked("pools_pool"):
        jobs.start_job("nightly")
    assert counts() == (0, 0, 0)


@pytest.mark.postgres
@pytest.mark.parametrize("path", ["pools/", "pools/warehouse/", "pools/warehouse/entries/"])
def test_rest_reads__locked_table_is_503_at_the_bound(recorder, short_bound, path):
    make_pool("warehouse", 1)
    submit("warehouse", key="k")
    client = client_for(*ALL_PERMS)
    began = time.monotonic()
    with table_locked("pools_pool"):
        response = client.get(url(path))
    took = time.monotonic() - began
    assert error(response) == (503, UNAVAILABLE)
    assert took < 3, f"answered after {took:.2f}s for a 0.3s bound"
    assert client.get(url(path)).status_code == 200  # the lock gone, it answers


@pytest.mark.postgres
def test_rest_entry__locked_table_is_503_at_the_bound(recorder, short_bound):
    make_pool("warehouse", 1)
    submit("warehouse", key="k")
    client = client_for(*ALL_PERMS)
    with table_locked("pools_queueentry"):
        assert error(client.get(url("entries/k/"))) == (503, UNAVAILABLE)


@pytest.mark.postgres
def test_admin_card__locked_table_shows_the_condition(recorder, short_bound):
    make_pool("warehouse", 1)
    client = Client()
    client.force_login(User.objects.create_superuser("root", password="pw"))
    began = time.monotonic()
    with table_locked("pools_pool"):
        index = client.get("/admin/")
        fragment = client.get("/admin/pools/pool/card/")
    assert time.monotonic() - began < 5
    assert index.status_code == 200 and "Pool state is unavailable." in index.content.decode()
    assert fragment.status_code == 200
    assert "data-pools-unavailable" in fragment.content.decode()
    assert 'data-pool="warehouse"' in client.get("/admin/").content.decode()
