"""The Resource pools card on the admin index: numbers, cancel from the card, unavailable state."""

from __future__ import annotations

import re
from unittest import mock

import pytest
from django.contrib.auth.models import Permission, User
from django.db import OperationalError, connection
from django.test import Client
from django.urls import reverse
from pytest_django import DjangoAssertNumQueries

from pools.core import admission, leases, pool_crud
from pools.models import Pool, QueueEntry
from pools.states import EntryState
from tests.support.admin import ADMIN_APPS, card_row, card_rows
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = pytest.mark.django_db(transaction=True, available_apps=ADMIN_APPS)

INDEX = "/admin/"


@pytest.fixture
def busy(recorder: RecordingBridge) -> RecordingBridge:
    """``wh`` (2 slots): one running and one admitted holder, four waiting; ``api`` paused."""
    make_pool("wh", 2)
    make_pool("api", 1, paused=True)
    submit("wh", key="run-1", priority=5)
    submit("wh", key="run-2", priority=5)
    adm = next(a for a in recorder.admissions if a.key == "run-1")
    leases.start(adm.entry_id, adm.token, worker="w1@host")
    submit("wh", key="wait-low", priority=1)
    submit("wh", key="wait-high", priority=9, queue_timeout=600)
    submit("wh", key="wait-mid", priority=5)
    submit("wh", key="wait-4", priority=0)
    submit("api", key="api-wait", priority=3)
    return recorder


def test_card__shows_held_waiting_head_priorities_and_deadline(
    admin_client: Client, busy: RecordingBridge
) -> None:
    html = admin_client.get(INDEX).content.decode()
    assert 'id="pools-card"' in html
    rows = card_rows(html)
    assert rows["wh"] == {"slots": 2, "held": 2, "waiting": 4}
    assert rows["api"] == {"slots": 1, "held": 0, "waiting": 1}
    # The head: first three waiting entries of wh in admission order, with priorities.
    wh = card_row(html, "wh")
    keys = re.findall(r'class="pools-entry" data-key="([^"]+)"', wh)
    assert keys == ["wait-high", "wait-mid", "wait-low"]
    assert re.findall(r">P(-?\d+)</span>", wh) == ["9", "5", "1"]
    # The nearest deadline as a relative time (queue_timeout=600 -> "in 10 min").
    assert re.search(r'deadline <time datetime="[^"]+" title="[^"]+">in 10 min</time>', wh)
    assert "4 waiting in all: see the queue" in wh
    # The paused pool says so, in text and in the bar's label.
    api = card_row(html, "api")
    assert "pools-badge-paused" in api and "0 of 1 slots held, 1 free, paused" in api
    # Held vs free as a segmented bar: two held slots, none free.
    assert wh.count('class="pools-slot is-held"') == 2
    assert "2 of 2 slots held, 0 free" in wh
    # The card is above the app list and brings its own local assets (no CDN).
    assert html.index('id="pools-card"') < html.index('class="app-pools')
    assert "/static/pools_admin/card.js" in html and "/static/pools_admin/pools.css" in html
    assert "http://" not in html.split('id="pools-card"')[1].split("</section>")[0]


def test_card__fragment_has_the_same_numbers_in_bounded_queries(
    admin_client: Client,
    busy: RecordingBridge,
    django_assert_max_num_queries: DjangoAssertNumQueries,
) -> None:
    url = reverse("admin:pools_pool_card")
    admin_client.get(url)  # warm the session and permission caches
    # 6, and on PostgreSQL the read's bound: BEGIN, SET LOCAL timeouts, COMMIT.
    bound = 3 if connection.vendor == "postgresql" else 0
    with django_assert_max_num_queries(6 + bound) as ctx:
        response = admin_client.get(url)
    assert response.status_code == 200
    rows = card_rows(response.content.decode())
    assert rows["wh"] == {"slots": 2, "held": 2, "waiting": 4}
    few = len(ctx.captured_queries)
    # Many more pools and entries: the card costs the same number of queries.
    for i in range(8):
        make_pool(f"extra-{i}", 1)
        for j in range(4):
            submit(f"extra-{i}", key=f"x{i}-{j}", priority=j)
    with django_assert_max_num_queries(few) as ctx:
        response = admin_client.get(url)
    assert len(card_rows(response.content.decode())) == len(rows) + 8
    assert len(ctx.captured_queries) == few


def test_card__draining_pool_shows_the_capacity_it_drains_to(
    admin_client: Client, busy: RecordingBridge
) -> None:
    """A lowered capacity waits for the queued entries: the card says "draining to N"."""
    pool_crud.update_pool("wh", slots=1)
    pool = Pool.objects.get(name="wh")
    assert (pool.slots, pool.pending_slots) == (2, 1), "the change waits for the line"
    html = admin_client.get(reverse("admin:pools_pool_card")).content.decode()
    wh = card_row(html, "wh")
    assert card_rows(html)["wh"] == {"slots": 2, "held": 2, "waiting": 4}
    badge = re.search(r'<span class="pools-badge pools-badge-draining"[^>]*>([^<]+)</span>', wh)
    assert badge is not None and badge.group(1) == "draining to 1"
    assert 'data-pools-draining="1"' in wh
    assert '2 of 2 slots held, 0 free, draining to 1 slot"' in wh
    # A pool that is not draining has no badge.
    assert "pools-badge-draining" not in card_row(html, "api")
    # Back to the capacity in effect: the drain ends and the badge goes.
    pool_crud.update_pool("wh", slots=2)
    html = admin_client.get(reverse("admin:pools_pool_card")).content.decode()
    assert "pools-badge-draining" not in card_row(html, "wh")


def test_card__cancel_control_cancels_the_waiting_entry(
    admin_client: Client, busy: RecordingBridge
) -> None:
    response = admin_client.post(
        reverse("admin:pools_queueentry_card_cancel"),
        {"key": "wait-mid"},
        HTTP_ACCEPT="application/json",
    )
    assert response.status_code == 200
    assert response.json()["ok"] is True
    assert "Cancelled" in response.json()["message"]
    assert QueueEntry.objects.get(key="wait-mid").state == EntryState.CANCELLED
    html = admin_client.get(reverse("admin:pools_pool_card")).content.decode()
    assert card_rows(html)["wh"]["waiting"] == 3
    assert 'data-key="wait-mid"' not in html


def test_card__cancel_without_js_redirects_with_a_message(
    admin_client: Client, busy: RecordingBridge
) -> None:
    response = admin_client.post(
        reverse("admin:pools_queueentry_card_cancel"), {"key": "wait-low"}, follow=True
    )
    assert response.redirect_chain[-1][0] == INDEX
    assert "Cancelled" in response.content.decode()
    assert QueueEntry.objects.get(key="wait-low").state == EntryState.CANCELLED


def test_card__refusal_message_is_the_pools_own(
    admin_client: Client, busy: RecordingBridge
) -> None:
    response = admin_client.post(
        reverse("admin:pools_queueentry_card_cancel"),
        {"key": "run-1"},
        HTTP_ACCEPT="application/json",
    )
    assert response.status_code == 409
    assert response.json() == {
        "ok": False,
        "message": "Entry 'run-1' in pool 'wh' is already running; pass terminate=True to "
        "stop it; only waiting entries can be cancelled.",
    }
    assert QueueEntry.objects.get(key="run-1").state == EntryState.RUNNING
    unknown = admin_client.post(
        reverse("admin:pools_queueentry_card_cancel"),
        {"key": "nope"},
        HTTP_ACCEPT="application/json",
    )
    assert unknown.status_code == 404
    assert unknown.json()["message"] == "No queue entry with key 'nope'."


def _staff(username: str, *perms: str) -> User:
    user = User.objects.create_user(username, password="pw", is_staff=True)
    for perm in perms:
        app, codename = perm.split(".")
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label=app, codename=codename)
        )
    return user


def test_card__viewer_sees_numbers_but_no_cancel_and_cannot_post(busy: RecordingBridge) -> None:
    client = Client()
    client.force_login(_staff("viewer", "pools.view_pool", "pools.view_queueentry"))
    html = client.get(INDEX).content.decode()
    assert card_rows(html)["wh"]["waiting"] == 4
    assert "pools-cancel" not in html
    response = client.post(
        reverse("admin:pools_queueentry_card_cancel"),
        {"key": "wait-low"},
        HTTP_ACCEPT="application/json",
    )
    assert response.status_code == 403
    assert QueueEntry.objects.get(key="wait-low").state == EntryState.WAITING


def test_card__change_permission_on_entries_does_not_cancel_and_the_card_says_why(
    busy: RecordingBridge,
) -> None:
    client = Client()
    client.force_login(_staff("editor", "pools.view_pool", "pools.change_queueentry"))
    html = client.get(INDEX).content.decode()
    assert "pools-cancel" not in html
    assert 'data-pools-permission="cancel"' in html and "pools.cancel_queueentry" in html
    response = client.post(
        reverse("admin:pools_queueentry_card_cancel"),
        {"key": "wait-low"},
        HTTP_ACCEPT="application/json",
    )
    assert response.status_code == 403
    assert QueueEntry.objects.get(key="wait-low").state == EntryState.WAITING


def test_card__cancel_permission_allows_cancel(busy: RecordingBridge) -> None:
    client = Client()
    client.force_login(_staff("operator", "pools.view_pool", "pools.cancel_queueentry"))
    html = client.get(INDEX).content.decode()
    assert "pools-cancel" in html
    assert 'data-pools-permission="cancel"' not in html
    response = client.post(
        reverse("admin:pools_queueentry_card_cancel"),
        {"key": "wait-low"},
        HTTP_ACCEPT="application/json",
    )
    assert response.status_code == 200
    assert QueueEntry.objects.get(key="wait-low").state == EntryState.CANCELLED


def test_card__hidden_without_view_permission(busy: RecordingBridge) -> None:
    client = Client()
    client.force_login(_staff("nobody"))
    html = client.get(INDEX).content.decode()
    assert client.get(INDEX).status_code == 200
    assert 'id="pools-card"' not in html
    assert client.get(reverse("admin:pools_pool_card")).status_code == 403


def test_card__cancel_needs_a_csrf_token(busy: RecordingBridge) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(User.objects.create_superuser("root", password="pw"))
    url = reverse("admin:pools_queueentry_card_cancel")
    refused = client.post(url, {"key": "wait-low"}, HTTP_ACCEPT="application/json")
    assert refused.status_code == 403
    assert QueueEntry.objects.get(key="wait-low").state == EntryState.WAITING
    # The token the card renders in its form is accepted.
    html = client.get(INDEX).content.decode()
    found = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', html)
    assert found is not None, "the card renders a CSRF token"
    token = found.group(1)
    accepted = client.post(
        url, {"key": "wait-low", "csrfmiddlewaretoken": token}, HTTP_ACCEPT="application/json"
    )
    assert accepted.status_code == 200
    assert QueueEntry.objects.get(key="wait-low").state == EntryState.CANCELLED


def test_card__get_is_not_a_cancel(admin_client: Client, busy: RecordingBridge) -> None:
    response = admin_client.get(reverse("admin:pools_queueentry_card_cancel") + "?key=wait-low")
    assert response.status_code == 405
    assert QueueEntry.objects.get(key="wait-low").state == EntryState.WAITING


def test_card__says_unavailable_instead_of_failing_the_page(
    admin_client: Client, busy: RecordingBridge
) -> None:
    with mock.patch(
        "pools_admin.board._pools_query",
        side_effect=OperationalError("could not connect to server"),
    ):
        response = admin_client.get(INDEX)
        fragment = admin_client.get(reverse("admin:pools_pool_card"))
    assert response.status_code == 200
    html = response.content.decode()
    assert "Pool state is unavailable." in html
    assert "could not connect to server" in html
    assert 'class="app-pools' in html  # the rest of the index is there
    assert fragment.status_code == 200 and "data-pools-unavailable" in fragment.content.decode()


def test_card__cancel_while_unavailable_is_503(admin_client: Client, busy: RecordingBridge) -> None:
    with mock.patch.object(admission, "cancel", side_effect=OperationalError("gone")):
        response = admin_client.post(
            reverse("admin:pools_queueentry_card_cancel"),
            {"key": "wait-low"},
            HTTP_ACCEPT="application/json",
        )
    assert response.status_code == 503
    assert response.json()["message"] == "Pool state is unavailable; nothing was cancelled."


def test_card__empty_and_continuous_bar(admin_client: Client, recorder: RecordingBridge) -> None:
    Pool.objects.all().delete()  # the pools settings define (synced on migrate)
    html = admin_client.get(INDEX).content.decode()
    assert "No pools yet" in html
    make_pool("big", 100)
    for i in range(3):
        submit("big", key=f"b{i}")
    html = admin_client.get(INDEX).content.decode()
    assert card_rows(html)["big"] == {"slots": 100, "held": 3, "waiting": 0}
    assert 'class="pools-fill" style="width: 3%"' in html


def test_card__deadline_is_the_nearest_of_waiting_entries(
    admin_client: Client, recorder: RecordingBridge
) -> None:
    make_pool("p", 1)
    submit("p", key="holder")
    submit("p", key="later", queue_timeout=3600)
    submit("p", key="sooner", queue_timeout=120)
    html = admin_client.get(INDEX).content.decode()
    row = card_row(html, "p")
    summary = row[: row.index("pools-bar")]
    assert re.search(r"deadline <time[^>]*>in 2 min</time>", summary)


def test_card__rate_only_pool_shows_its_rate_not_a_slot_count(
    admin_client: Client, recorder: RecordingBridge
) -> None:
    """A pool with a rate and no slots is stored with UNLIMITED_SLOTS: the card must not
    print that number, draw a bar of it, or add it to the caption's total."""
    from pools.core import rates

    make_pool("wh", 2)
    make_pool("partner", rates.UNLIMITED_SLOTS, rate="20/s,100/m")
    submit("wh", key="w1")
    submit("partner", key="p1")
    html = admin_client.get(INDEX).content.decode()
    assert str(rates.UNLIMITED_SLOTS) not in html.replace('data-slots="2147483647"', "")
    row = card_row(html, "partner")
    assert "running, no slot limit" in row
    assert "rate 20/s, 100/m" in row
    assert "pools-bar" not in row
    assert "1 of 2 slots held" in html  # the caption counts the pool that has slots
    wh = card_row(html, "wh")
    assert "/2 held" in wh and "pools-bar" in wh and "rate " not in wh
