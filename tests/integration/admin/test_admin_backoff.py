"""Admin: the card's backoff badge and the "End backoff" pool action (through the service)."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse

from pools.core import backoffs
from pools.models import Pool, PoolEvent, QueueEntry
from pools.states import EntryState, EventKind
from tests.support.admin import ADMIN_APPS, card_row
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = pytest.mark.django_db(transaction=True, available_apps=ADMIN_APPS)


@pytest.fixture
def backing_off(recorder: RecordingBridge) -> RecordingBridge:
    """``api`` backs off for a minute (its entry ``a`` waits again); ``wh`` is paused by hand."""
    make_pool("api", 1)
    make_pool("wh", 1, paused=True)
    entry = QueueEntry.objects.get(pk=submit("api", key="a").entry_id)
    assert backoffs.back_off(entry.queue_id, entry.token, 60, limit=5).requeued
    return recorder


def _end_backoffs(client: Client, *names: str) -> str:
    pks = [str(Pool.objects.get(name=n).pk) for n in names]
    response = client.post(
        reverse("admin:pools_pool_changelist"),
        {"action": "end_backoffs", "_selected_action": pks},
        follow=True,
    )
    return response.content.decode()


def test_card__a_pool_in_backoff_shows_until_when(
    admin_client: Client, backing_off: RecordingBridge
) -> None:
    html = admin_client.get(reverse("admin:pools_pool_card")).content.decode()
    api = card_row(html, "api")
    until = Pool.objects.get(name="api").backoff_until
    assert until is not None
    assert f"backoff until {until:%H:%M:%S}" in api and "data-pools-backoff=" in api
    assert ">paused<" not in api
    # A pool paused by hand keeps its plain badge.
    wh = card_row(html, "wh")
    assert ">paused<" in wh and "backoff" not in wh
    # The pool's own page says it too.
    page = admin_client.get(reverse("admin:pools_pool_occupancy", args=["api"])).content.decode()
    assert f"backoff until {until:%H:%M:%S}" in page


def test_action__end_backoff_resumes_logs_the_user_and_leaves_a_manual_pause(
    admin_client: Client, backing_off: RecordingBridge
) -> None:
    page = _end_backoffs(admin_client, "api", "wh")
    assert "Ended the backoff of api." in page
    assert not Pool.objects.get(name="api").paused
    assert Pool.objects.get(name="wh").paused
    assert QueueEntry.objects.get(key="a").state == EntryState.ADMITTED
    ended = PoolEvent.objects.get(kind=EventKind.BACKOFF, entry_id=None)
    assert ended.actor == "admin"
    assert "no selected pool is backing off" in _end_backoffs(admin_client, "api")


def test_action__end_backoff_needs_change_pool(backing_off: RecordingBridge) -> None:
    viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_pool"))
    client = Client()
    client.force_login(viewer)
    _end_backoffs(client, "api")
    assert Pool.objects.get(name="api").backoff_until is not None
