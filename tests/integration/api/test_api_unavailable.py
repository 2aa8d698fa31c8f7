"""REST API: 503 ``{"detail": "pool state is unavailable"}`` when the pool store cannot answer.

On PostgreSQL a second connection holds the pool row (``SELECT ... FOR UPDATE``) past
``LOCK_TIMEOUT_SECONDS``: every write endpoint gives up at its bound and answers 503,
having changed nothing. A database error on a read answers 503 as well.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from unittest import mock

import pytest
from django.db import OperationalError
from django_celery_beat.models import IntervalSchedule, PeriodicTask
from pytest_django import Settings
from rest_framework.response import Response
from rest_framework.test import APIClient

from pools.models import Pool, QueueEntry
from pools.states import EntryState
from tests.integration.core.test_locking import pool_row_locked
from tests.support.api import ALL_PERMS, API_APPS, client_for, error, url
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit
from tests.testapp.tasks import add

pytestmark = pytest.mark.django_db(transaction=True, available_apps=API_APPS)

UNAVAILABLE = {"detail": "pool state is unavailable"}


@pytest.fixture
def admin_client() -> APIClient:
    return client_for(*ALL_PERMS)


@pytest.fixture
def short_bound(settings: Settings) -> None:
    settings.POOLS = {**settings.POOLS, "LOCK_TIMEOUT_SECONDS": 0.3}


def timed(call: Callable[[], Response]) -> tuple[Response, float]:
    began = time.monotonic()
    response = call()
    return response, time.monotonic() - began


@pytest.mark.postgres
def test_cancel__locked_pool_is_503_and_nothing_changes(
    recorder: RecordingBridge, admin_client: APIClient, short_bound: None
) -> None:
    make_pool("p", 1)
    submit("p", key="run")
    submit("p", key="w")
    with pool_row_locked("p"):
        response, took = timed(lambda: admin_client.post(url("pools/p/queue/w/cancel")))
    assert error(response) == (503, UNAVAILABLE)
    assert 0.25 <= took < 5, f"answered after {took:.2f}s for a 0.3s bound"
    assert QueueEntry.objects.get(key="w").state == EntryState.WAITING
    # With the lock gone the same request succeeds.
    assert admin_client.post(url("pools/p/queue/w/cancel")).status_code == 200


@pytest.mark.postgres
def test_start_job__locked_pool_is_503_and_nothing_is_queued(
    recorder: RecordingBridge, admin_client: APIClient, short_bound: None
) -> None:
    make_pool("warehouse", 1)
    every, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.HOURS)
    PeriodicTask.objects.create(
        name="nightly", task=add.name, interval=every, args=json.dumps([1, 2])
    )
    with pool_row_locked("warehouse"):
        response = admin_client.post(url("jobs/nightly/start"))
    assert error(response) == (503, UNAVAILABLE)
    assert not QueueEntry.objects.exists()


@pytest.mark.postgres
def test_patch_and_delete_pool__locked_pool_is_503(
    recorder: RecordingBridge, admin_client: APIClient, short_bound: None
) -> None:
    make_pool("p", 1)
    with pool_row_locked("p"):
        patched = admin_client.patch(url("pools/p/"), {"slots": 5}, format="json")
        deleted = admin_client.delete(url("pools/p/"))
    assert error(patched) == (503, UNAVAILABLE)
    assert error(deleted) == (503, UNAVAILABLE)
    assert Pool.objects.get(name="p").slots == 1


def test_reads__database_error_is_503(admin_client: APIClient) -> None:
    boom = OperationalError("server closed the connection unexpectedly")
    with mock.patch("pools.core.snapshots.snapshot_all", side_effect=boom):
        assert error(admin_client.get(url("pools/"))) == (503, UNAVAILABLE)
    with mock.patch("pools.core.explain.explain_key", side_effect=boom):
        assert error(admin_client.get(url("entries/k/"))) == (503, UNAVAILABLE)
