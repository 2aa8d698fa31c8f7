"""REST API: ``POST pools/<name>/pause`` and ``POST pools/<name>/resume``."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from pools.core import admission
from pools.models import Pool, PoolEvent, QueueEntry
from pools.states import EntryState, EventKind
from tests.support.api import API_APPS, client_for, error, url
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = pytest.mark.django_db(transaction=True, available_apps=API_APPS)


@pytest.fixture
def changer() -> APIClient:
    return client_for("pools.change_pool")


def pause_events(name: str) -> list[dict[str, object]]:
    return [
        e.detail
        for e in PoolEvent.objects.filter(pool=name, kind=EventKind.CAPACITY_CHANGED)
        if "paused" in e.detail
    ]


def test_pause__pauses_the_pool_and_waiting_entries_keep_their_place(
    recorder: RecordingBridge, changer: APIClient
) -> None:
    make_pool("p", 1)
    submit("p", key="run")
    submit("p", key="w1")
    status, body = error(changer.post(url("pools/p/pause")))
    assert status == 200
    assert (body["name"], body["paused"]) == ("p", True)
    assert Pool.objects.get(name="p").paused
    assert pause_events("p") == [{"paused": True}]
    # The holder finishes: nothing is admitted while paused, w1 keeps its place.
    run = QueueEntry.objects.get(key="run")
    admission.settle(run.queue_id, run.token, EntryState.SUCCEEDED)
    assert QueueEntry.objects.get(key="w1").state == EntryState.WAITING
    assert [a.key for a in recorder.admissions] == ["run"]


def test_pause__twice_is_idempotent_and_logs_once(
    recorder: RecordingBridge, changer: APIClient
) -> None:
    make_pool("p", 1)
    assert changer.post(url("pools/p/pause")).status_code == 200
    status, body = error(changer.post(url("pools/p/pause")))
    assert (status, body["paused"]) == (200, True)
    assert pause_events("p") == [{"paused": True}]


def test_resume__admits_the_head_and_answers_the_pool(
    recorder: RecordingBridge, changer: APIClient
) -> None:
    make_pool("p", 1, paused=True)
    submit("p", key="w1")
    assert QueueEntry.objects.get(key="w1").state == EntryState.WAITING
    status, body = error(changer.post(url("pools/p/resume")))
    assert (status, body["paused"]) == (200, False)
    assert not Pool.objects.get(name="p").paused
    assert QueueEntry.objects.get(key="w1").state == EntryState.ADMITTED
    assert [a.key for a in recorder.admissions] == ["w1"]
    assert pause_events("p") == [{"paused": False}]
    # Resuming a running pool changes and logs nothing.
    assert changer.post(url("pools/p/resume")).status_code == 200
    assert pause_events("p") == [{"paused": False}]


@pytest.mark.parametrize("action", ["pause", "resume"])
def test_pause_resume__unknown_pool_is_404(changer: APIClient, action: str) -> None:
    status, body = error(changer.post(url(f"pools/nope/{action}")))
    assert status == 404
    assert body["code"] == "unknown_pool" and "nope" in body["detail"]


@pytest.mark.parametrize("action", ["pause", "resume"])
@pytest.mark.parametrize("perm", ["pools.view_pool", "pools.cancel_queueentry", None])
def test_pause_resume__needs_change_pool(action: str, perm: str | None) -> None:
    make_pool("p", 1, paused=(action == "resume"))
    client = client_for(*([perm] if perm else []))
    status, body = error(client.post(url(f"pools/p/{action}")))
    assert (status, body["code"]) == (403, "permission_denied")
    assert Pool.objects.get(name="p").paused is (action == "resume")
    assert pause_events("p") == []


@pytest.mark.parametrize("action", ["pause", "resume"])
def test_pause_resume__get_is_not_allowed(changer: APIClient, action: str) -> None:
    make_pool("p", 1)
    client = client_for("pools.view_pool", "pools.change_pool")
    assert client.get(url(f"pools/p/{action}")).status_code == 405
