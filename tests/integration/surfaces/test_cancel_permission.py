"""One permission cancels an entry on every surface: ``pools.cancel_queueentry``.

The REST cancel endpoint, the card's Cancel and the entry list's two actions each refuse a
user holding only ``pools.change_queueentry`` and let one holding only the cancel
permission through; where a surface hides its Cancel control it says which permission it
needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse
from django.utils.html import escape

from pools import permissions
from pools.models import QueueEntry
from pools.states import EntryState
from tests.support.admin import ADMIN_APPS
from tests.support.api import make_user, url
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = pytest.mark.django_db(transaction=True, available_apps=ADMIN_APPS)

VIEWS = ("pools.view_pool", "pools.view_queueentry")


@pytest.fixture
def line(recorder: RecordingBridge) -> RecordingBridge:
    """``wh`` (1 slot): ``run`` holds it, ``w`` waits."""
    make_pool("wh", 1)
    submit("wh", key="run")
    submit("wh", key="w")
    return recorder


def _qid(key: str) -> int:
    return QueueEntry.objects.get(key=key).queue_id


def _rest(client: Client) -> Any:
    return client.post(url("pools/wh/queue/w/cancel"), {}, content_type="application/json")


def _card(client: Client) -> Any:
    return client.post(
        reverse("admin:pools_queueentry_card_cancel"), {"key": "w"}, HTTP_ACCEPT="application/json"
    )


def _action(name: str) -> Callable[[Client], Any]:
    def send(client: Client) -> Any:
        return client.post(
            reverse("admin:pools_queueentry_changelist"),
            {"action": name, "_selected_action": [str(_qid("w"))]},
        )

    return send


SURFACES = {
    "REST cancel": _rest,
    "card cancel": _card,
    "cancel action": _action("cancel_entries"),
    "cancel-and-terminate action": _action("cancel_and_terminate"),
}


def _client(*perms: str) -> Client:
    client = Client()
    client.force_login(make_user(*VIEWS, *perms, staff=True))
    return client


@pytest.mark.parametrize("surface", list(SURFACES))
def test_change_permission_alone__cancels_nothing_on_any_surface(line, surface):
    SURFACES[surface](_client("pools.change_queueentry"))
    assert QueueEntry.objects.get(key="w").state == EntryState.WAITING


@pytest.mark.parametrize("surface", list(SURFACES))
def test_cancel_permission__cancels_on_every_surface(line, surface):
    SURFACES[surface](_client(permissions.CANCEL_ENTRY))
    assert QueueEntry.objects.get(key="w").state == EntryState.CANCELLED


def test_entry_list__without_the_permission_says_why_the_actions_are_missing(line):
    page = _client("pools.change_queueentry").get(reverse("admin:pools_queueentry_changelist"))
    html = page.content.decode()
    assert 'value="cancel_entries"' not in html
    assert 'data-pools-permission="cancel"' in html and permissions.CANCEL_ENTRY in html


def test_entry_list__with_the_permission_offers_the_actions_and_no_note(line):
    page = _client(permissions.CANCEL_ENTRY).get(reverse("admin:pools_queueentry_changelist"))
    html = page.content.decode()
    assert 'value="cancel_entries"' in html and 'value="cancel_and_terminate"' in html
    assert 'data-pools-permission="cancel"' not in html


def test_card__without_the_permission_says_why_there_is_no_cancel(line):
    html = _client().get("/admin/").content.decode()
    assert "pools-cancel-button" not in html
    assert 'data-pools-permission="cancel"' in html
    assert escape(permissions.missing("Cancelling entries", permissions.CANCEL_ENTRY)) in html


def test_rest__refusal_names_the_permission(line):
    response = _rest(_client("pools.change_queueentry"))
    assert response.status_code == 403
    assert response.json()["code"] == "permission_denied"
    assert permissions.CANCEL_ENTRY in response.json()["detail"]


def test_labels__are_the_names_the_admin_shows_for_each_permission(line):
    """The why-texts quote each permission by the name the admin's user form gives it."""
    for perm, label in permissions.LABELS.items():
        app_label, codename = perm.split(".")
        row = Permission.objects.get(content_type__app_label=app_label, codename=codename)
        assert row.name == label, perm
