"""The audit trail: every configuration change and cancellation made in the admin or the
REST API is in the event log with the acting user; changes made in code have no actor."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from rest_framework.test import APIClient

from pools import signals
from pools.core import capacity, pool_crud
from pools.models import Pool, PoolEvent, QueueEntry
from pools.states import EventKind
from tests.support.admin import ADMIN_APPS
from tests.support.api import ALL_PERMS, make_user, url
from tests.support.bridge import RecordingBridge
from tests.support.factories import submit

pytestmark = pytest.mark.django_db(transaction=True, available_apps=ADMIN_APPS)


#: The other fields of the admin's pool form, as it shows them.
FORM = {"description": "", "overflow": "reject", "paused_policy": "queue", "strategy": "priority"}


def _log(*pools: str) -> list[tuple[str, str, str, dict[str, Any]]]:
    rows = PoolEvent.objects.filter(pool__in=pools).order_by("id")
    return [(r.kind, r.pool, r.actor, r.detail) for r in rows]


def test_scripted_scenario__admin_and_api_changes_are_logged_with_their_actor(
    admin_client: Client, admin_user: User, recorder: RecordingBridge
) -> None:
    sent: list[tuple[str, str]] = []

    def listen(sender: Any = None, event: PoolEvent | None = None, **kwargs: Any) -> None:
        assert event is not None
        sent.append((event.kind, event.actor))

    receivers = [signals.pool_created, signals.pool_changed, signals.pool_deleted]
    receivers += [signals.entry_cancelled, signals.entry_terminate_requested]
    for signal in receivers:
        signal.connect(listen, weak=False)
    try:
        _scenario(admin_client, admin_user)
    finally:
        for signal in receivers:
            signal.disconnect(listen)
    admin = admin_user.get_username()
    api = User.objects.exclude(pk=admin_user.pk).get().get_username()
    assert _log("adm", "api") == [
        # Admin: create, edit capacity and backlog, pause, resume, cancel, delete.
        (EventKind.POOL_CREATED, "adm", admin, {"slots": 2, "max_queued": None, "paused": False}),
        (EventKind.CAPACITY_CHANGED, "adm", admin, {"from": 2, "to": 3}),
        (EventKind.CAPACITY_CHANGED, "adm", admin, {"field": "max_queued", "from": None, "to": 9}),
        (EventKind.CAPACITY_CHANGED, "adm", admin, {"paused": True}),
        (EventKind.CAPACITY_CHANGED, "adm", admin, {"paused": False}),
        (
            EventKind.CANCELLED,
            "adm",
            admin,
            {"slots": 1, "reason": f"cancelled in the admin by {admin}"},
        ),
        (
            EventKind.TERMINATE,
            "adm",
            admin,
            {"slots": 3, "reason": f"cancelled in the admin by {admin}"},
        ),
        # API: create, change capacity, pause, cancel, delete.
        (EventKind.POOL_CREATED, "api", api, {"slots": 1, "max_queued": None, "paused": False}),
        (EventKind.CAPACITY_CHANGED, "api", api, {"from": 1, "to": 4}),
        (EventKind.CAPACITY_CHANGED, "api", api, {"paused": True}),
        (
            EventKind.CANCELLED,
            "api",
            api,
            {"slots": 1, "reason": f"cancelled via the API by {api}"},
        ),
        (EventKind.POOL_DELETED, "api", api, {}),
        # The admin deletes its pool last (after its entries finished).
        (EventKind.POOL_DELETED, "adm", admin, {}),
    ]
    # The signals carried the same events and actors, in order.
    assert sent == [(kind, actor) for kind, _pool, actor, _detail in _log("adm", "api")]


def _scenario(admin_client: Client, admin_user: User) -> None:
    add_url = reverse("admin:pools_pool_add")
    response = admin_client.post(add_url, {"name": "adm", "slots": 2, **FORM})
    assert response.status_code == 302, response.context["adminform"].form.errors
    pk = Pool.objects.get(name="adm").pk
    change_url = reverse("admin:pools_pool_change", args=[pk])
    response = admin_client.post(change_url, {"slots": 3, "max_queued": 9, **FORM}, follow=True)
    assert response.status_code == 200
    for action in ("pause_pools", "resume_pools"):
        admin_client.post(
            reverse("admin:pools_pool_changelist"),
            {"action": action, "_selected_action": [str(pk)]},
        )
    # Three waiting entries (a holder keeps the pool busy: adm has 3 slots, demand 3).
    submit("adm", 3, key="adm-holder")
    submit("adm", 1, key="adm-waiting")
    waiting = QueueEntry.objects.get(key="adm-waiting")
    admin_client.post(
        reverse("admin:pools_queueentry_changelist"),
        {"action": "cancel_entries", "_selected_action": [str(waiting.queue_id)]},
    )
    holder = QueueEntry.objects.get(key="adm-holder")
    admin_client.post(
        reverse("admin:pools_queueentry_changelist"),
        {"action": "cancel_and_terminate", "_selected_action": [str(holder.queue_id)]},
    )

    api = APIClient()
    api.force_login(make_user(*ALL_PERMS))
    assert api.post(url("pools/"), {"name": "api", "slots": 1}, format="json").status_code == 201
    assert api.patch(url("pools/api/"), {"slots": 4}, format="json").status_code == 200
    assert api.patch(url("pools/api/"), {"paused": True}, format="json").status_code == 200
    submit("api", 1, key="api-waiting")  # paused: it waits
    response = api.post(url("pools/api/queue/api-waiting/cancel"), {}, format="json")
    assert response.status_code == 200, response.content
    assert api.delete(url("pools/api/")).status_code == 204

    holder = QueueEntry.objects.get(key="adm-holder")
    from pools.core import admission

    admission.settle(holder.queue_id, holder.token, "succeeded")
    response = admin_client.post(reverse("admin:pools_pool_delete", args=[pk]), {"post": "yes"})
    assert response.status_code == 302
    assert not Pool.objects.filter(name__in=["adm", "api"]).exists()


def test_changes_made_in_code__have_no_actor(recorder: RecordingBridge) -> None:
    pool_crud.create_pool(name="code", slots=1)
    pool_crud.update_pool("code", slots=2)
    capacity.set_paused("code", True)
    pool_crud.delete_pool("code")
    assert {actor for _k, _p, actor, _d in _log("code")} == {""}
    assert [k for k, *_ in _log("code")] == [
        EventKind.POOL_CREATED,
        EventKind.CAPACITY_CHANGED,
        EventKind.CAPACITY_CHANGED,
        EventKind.POOL_DELETED,
    ]


def test_admin_event_list__shows_the_actor(
    admin_client: Client, admin_user: User, recorder: RecordingBridge
) -> None:
    pool_crud.create_pool(name="shown", slots=1, actor="alice")
    html = admin_client.get(reverse("admin:pools_poolevent_changelist")).content.decode()
    assert 'class="field-actor">alice<' in html
