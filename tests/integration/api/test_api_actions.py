"""REST API: cancel an entry and start a periodic task — every status code but 503."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django_celery_beat.models import IntervalSchedule, PeriodicTask
from pytest_django import Settings
from rest_framework.test import APIClient

from pools.models import QueueEntry
from pools.states import EntryState, Origin
from tests.support.api import API_APPS, client_for, error, url
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit
from tests.testapp.tasks import add

pytestmark = pytest.mark.django_db(transaction=True, available_apps=API_APPS)


@pytest.fixture
def canceller() -> APIClient:
    return client_for("pools.cancel_queueentry")


@pytest.fixture
def starter() -> APIClient:
    return client_for("pools.start_job")


def periodic(name: str, task: str, **kw: Any) -> PeriodicTask:
    every, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.HOURS)
    return PeriodicTask.objects.create(name=name, task=task, interval=every, **kw)


# --------------------------------------------------------------------------- cancel


def test_cancel__waiting_entry_is_200_with_the_entry(
    recorder: RecordingBridge, canceller: APIClient
) -> None:
    make_pool("p", 1)
    submit("p", key="run")
    submit("p", key="w")
    status, body = error(canceller.post(url("pools/p/queue/w/cancel")))
    assert status == 200
    assert (body["key"], body["state"], body["demand"]) == ("w", "cancelled", {"p": 1})
    assert body["reason"].startswith("cancelled via the API by user")
    assert [f.key for f in recorder.finished] == ["w"], "its result becomes a revocation"


def test_cancel__running_entry_without_terminate_is_409(
    recorder: RecordingBridge, canceller: APIClient
) -> None:
    make_pool("p", 1)
    submit("p", key="run")
    status, body = error(canceller.post(url("pools/p/queue/run/cancel"), {}, format="json"))
    assert status == 409
    assert body == {
        "detail": "Entry 'run' in pool 'p' is already running; pass terminate=True to stop it; "
        "only waiting entries can be cancelled.",
        "code": "not_cancellable",
    }
    assert QueueEntry.objects.get(key="run").state == EntryState.ADMITTED


def test_cancel__terminate_stops_a_held_entry(
    recorder: RecordingBridge, canceller: APIClient
) -> None:
    make_pool("p", 1)
    submit("p", key="run")
    status, body = error(
        canceller.post(url("pools/p/queue/run/cancel"), {"terminate": True}, format="json")
    )
    assert status == 200 and body["key"] == "run"
    assert recorder.terminated == ["run"]


def test_cancel__finished_entry_is_409(recorder: RecordingBridge, canceller: APIClient) -> None:
    make_pool("p", 1)
    submit("p", key="run")
    submit("p", key="w")
    assert canceller.post(url("pools/p/queue/w/cancel")).status_code == 200
    status, body = error(canceller.post(url("pools/p/queue/w/cancel")))
    assert (status, body["code"]) == (409, "not_cancellable")
    assert "is already cancelled" in body["detail"]


def test_cancel__unknown_pool_key_or_other_pool_is_404(
    recorder: RecordingBridge, canceller: APIClient
) -> None:
    make_pool("p", 1)
    make_pool("q", 1)
    submit("p", key="in-p")
    status, body = error(canceller.post(url("pools/nope/queue/in-p/cancel")))
    assert (status, body["code"]) == (404, "unknown_pool")
    status, body = error(canceller.post(url("pools/p/queue/nope/cancel")))
    assert (status, body["code"]) == (404, "entry_not_found")
    status, body = error(canceller.post(url("pools/q/queue/in-p/cancel")))
    assert (status, body["code"]) == (404, "entry_not_found")
    assert QueueEntry.objects.get(key="in-p").state == EntryState.ADMITTED


def test_cancel__bad_body_is_400(recorder: RecordingBridge, canceller: APIClient) -> None:
    make_pool("p", 1)
    submit("p", key="run")
    status, body = error(
        canceller.post(url("pools/p/queue/run/cancel"), {"terminate": "maybe"}, format="json")
    )
    assert status == 400 and "terminate" in body


# --------------------------------------------------------------------------- jobs


def test_start_job__pooled_task_is_202_queued(
    recorder: RecordingBridge, starter: APIClient
) -> None:
    make_pool("warehouse", 1)
    periodic("nightly", add.name, args=json.dumps([1, 2]))
    status, body = error(starter.post(url("jobs/nightly/start")))
    assert status == 202
    entry = QueueEntry.objects.get(key=body["key"])
    assert body == {
        "queued": True,
        "key": entry.key,
        "queue_id": entry.queue_id,
        "pool": "warehouse",
        "pools": ["warehouse"],
        "existing": False,
    }
    assert entry.origin == Origin.MANUAL and entry.args == [1, 2]


def test_start_job__multi_pool_task_names_the_first_pool(
    recorder: RecordingBridge, starter: APIClient, settings: Settings
) -> None:
    settings.POOLS = {**settings.POOLS, "TASKS": {"tests.multi": {"pools": {"b": 1, "a": 1}}}}
    make_pool("a", 1)
    make_pool("b", 1)
    periodic("multi", "tests.multi")
    status, body = error(starter.post(url("jobs/multi/start")))
    assert status == 202 and (body["pool"], body["pools"]) == ("a", ["a", "b"])


@pytest.mark.redis
def test_start_job__unpooled_task_is_202_not_queued(starter: APIClient) -> None:
    periodic("plain", "tests.not_pooled")
    status, body = error(starter.post(url("jobs/plain/start")))
    assert status == 202 and body == {"queued": False, "key": body["key"]}


def test_start_job__unknown_job_is_404(starter: APIClient) -> None:
    status, body = error(starter.post(url("jobs/ghost/start")))
    assert (status, body["code"]) == (404, "job_not_found")
    assert "No periodic task named 'ghost'" in body["detail"]


def test_start_job__full_pool_is_409_with_its_message(
    recorder: RecordingBridge, starter: APIClient
) -> None:
    make_pool("warehouse", 1, max_queued=1)
    periodic("nightly", add.name, args="[1, 1]")
    assert starter.post(url("jobs/nightly/start")).status_code == 202  # admitted
    assert starter.post(url("jobs/nightly/start")).status_code == 202  # waits
    status, body = error(starter.post(url("jobs/nightly/start")))
    assert status == 409
    assert body["code"] == "pool_full"
    assert body["detail"].startswith("Pool 'warehouse' is full")


def test_start_job__task_naming_a_missing_pool_is_409(
    recorder: RecordingBridge, starter: APIClient, settings: Settings
) -> None:
    settings.POOLS = {**settings.POOLS, "TASKS": {"tests.lost": {"pools": {"missing": 1}}}}
    periodic("lost", "tests.lost")
    status, body = error(starter.post(url("jobs/lost/start")))
    assert (status, body["code"]) == (409, "unknown_pool")
    assert "Pool 'missing' does not exist" in body["detail"]
