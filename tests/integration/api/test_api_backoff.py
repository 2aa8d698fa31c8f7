"""REST API: a pool's ``backoff_until`` and ``backoffs``, and ``POST pools/<name>/end-backoff``."""

from __future__ import annotations

import pytest

from pools.core import backoffs, capacity
from pools.models import Pool, PoolEvent, QueueEntry
from pools.states import EntryState, EventKind
from tests.support.api import API_APPS, client_for, error, url
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = pytest.mark.django_db(transaction=True, available_apps=API_APPS)


def back_off(name: str, key: str) -> None:
    entry = QueueEntry.objects.get(pk=submit(name, key=key).entry_id)
    assert backoffs.back_off(entry.queue_id, entry.token, 60, limit=5).requeued


def test_pool__shows_its_backoff_and_explain_says_why(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    back_off("p", "a")
    viewer = client_for("pools.view_pool")
    status, body = error(viewer.get(url("pools/p/")))
    assert status == 200
    until = Pool.objects.get(name="p").backoff_until
    assert until is not None
    assert (body["paused"], body["backoffs"]) == (True, 1)
    assert body["backoff_until"].replace("Z", "+00:00") == until.isoformat()
    assert body["waiting"][0]["blocked_by"] == "backoff"
    status, body = error(viewer.get(url("pools/")))
    assert [p["backoff_until"] is not None for p in body if p["name"] == "p"] == [True]


def test_end_backoff__resumes_now_logs_the_user_and_admits(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    back_off("p", "a")
    status, body = error(client_for("pools.change_pool").post(url("pools/p/end-backoff")))
    assert status == 200
    assert (body["paused"], body["backoff_until"], body["backoffs"]) == (False, None, 1)
    assert QueueEntry.objects.get(key="a").state == EntryState.ADMITTED
    ended = PoolEvent.objects.get(kind=EventKind.BACKOFF, entry_id=None)
    assert ended.detail["ended"] == "early" and ended.actor
    # Idempotent; a pool paused by hand stays paused.
    capacity.set_paused("p", True)
    status, body = error(client_for("pools.change_pool").post(url("pools/p/end-backoff")))
    assert (status, body["paused"]) == (200, True)


@pytest.mark.parametrize("perm", ["pools.view_pool", "pools.cancel_queueentry", None])
def test_end_backoff__needs_change_pool(recorder: RecordingBridge, perm: str | None) -> None:
    make_pool("p", 1)
    back_off("p", "a")
    client = client_for(*([perm] if perm else []))
    status, body = error(client.post(url("pools/p/end-backoff")))
    assert (status, body["code"]) == (403, "permission_denied")
    assert Pool.objects.get(name="p").backoff_until is not None


def test_end_backoff__unknown_pool_is_404(recorder: RecordingBridge) -> None:
    status, body = error(client_for("pools.change_pool").post(url("pools/nope/end-backoff")))
    assert (status, body["code"]) == (404, "unknown_pool")
