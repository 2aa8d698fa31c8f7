"""Admin security review: every pools page, view and action refuses who it should.

One test per refusal and surface (docs/reference/security.md has the table):

- anonymous: redirected to the admin login, nothing runs;
- logged in but not staff (even holding every permission): redirected to the login;
- staff without the surface's permission: 403 for a view, the action is not offered
  (and a forged POST of it does nothing) for an admin action;
- a POST without the CSRF token: 403 (Django's CSRF failure page), nothing changed.

Every refused request leaves the tables as they were. A superuser control shows each
POST does change something when it is allowed, so "nothing changed" means refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from pools.models import Pool, PoolEvent, QueueEntry
from tests.support.admin import ADMIN_APPS
from tests.support.factories import make_pool, submit
from tests.testapp.tasks import add

pytestmark = pytest.mark.django_db(transaction=True, available_apps=ADMIN_APPS)

LOGIN = "/admin/login/"

#: Every permission a pools admin surface may ask for.
PERMS = (
    "pools.view_pool",
    "pools.add_pool",
    "pools.change_pool",
    "pools.delete_pool",
    "pools.view_queueentry",
    "pools.change_queueentry",
    "pools.cancel_queueentry",
    "pools.start_job",
    "pools.view_poolevent",
    "django_celery_beat.view_periodictask",
    "django_celery_beat.change_periodictask",
)


def _qid(key: str) -> int:
    return QueueEntry.objects.get(key=key).queue_id


def _job_pk() -> int:
    return int(PeriodicTask.objects.get(name="nightly").pk)


#: The pool form's policy fields, at their defaults.
POLICIES = {"overflow": "reject", "paused_policy": "queue", "strategy": "priority"}


@dataclass(frozen=True)
class Surface:
    """One admin page, view or action: how to call it and which permissions open it."""

    name: str
    method: str
    path: Callable[[], str]
    #: Any one of these opens it (the admin's own rules, e.g. view OR change).
    perms: tuple[str, ...]
    data: Callable[[], dict[str, Any]] = field(default=lambda: {})
    #: An admin action (refused by not being offered) rather than a view (403).
    action: bool = False


def _action(model: str, action: str, keys: Callable[[], list[int]]) -> dict[str, Any]:
    return {"action": action, "_selected_action": [str(pk) for pk in keys()]}


SURFACES = [
    Surface("card fragment", "get", lambda: reverse("admin:pools_pool_card"), ("pools.view_pool",)),
    Surface(
        "pool occupancy page",
        "get",
        lambda: reverse("admin:pools_pool_occupancy", args=["wh"]),
        ("pools.view_pool",),
    ),
    Surface(
        "run panel",
        "get",
        lambda: reverse("admin:pools_queueentry_run", args=["root-1"]),
        ("pools.view_queueentry",),
    ),
    Surface(
        "entry panel",
        "get",
        lambda: reverse("admin:pools_queueentry_panel", args=[_qid("w")]),
        ("pools.view_queueentry",),
    ),
    Surface(
        "entry detail",
        "get",
        lambda: reverse("admin:pools_queueentry_change", args=[_qid("w")]),
        ("pools.view_queueentry", "pools.change_queueentry"),
    ),
    Surface(
        "event list",
        "get",
        lambda: reverse("admin:pools_poolevent_changelist"),
        ("pools.view_poolevent",),
    ),
    Surface(
        "pool list",
        "get",
        lambda: reverse("admin:pools_pool_changelist"),
        ("pools.view_pool", "pools.change_pool"),
    ),
    Surface(
        "card cancel",
        "post",
        lambda: reverse("admin:pools_queueentry_card_cancel"),
        ("pools.cancel_queueentry",),
        data=lambda: {"key": "w"},
    ),
    Surface(
        "pool add",
        "post",
        lambda: reverse("admin:pools_pool_add"),
        ("pools.add_pool",),
        data=lambda: {"name": "new", "slots": "1", "max_queued": "", "description": "", **POLICIES},
    ),
    Surface(
        "pool change",
        "post",
        lambda: reverse("admin:pools_pool_change", args=[Pool.objects.get(name="spare").pk]),
        ("pools.change_pool",),
        data=lambda: {"slots": "5", "max_queued": "", "description": "x", **POLICIES},
    ),
    Surface(
        "pool delete",
        "post",
        lambda: reverse("admin:pools_pool_delete", args=[Pool.objects.get(name="spare").pk]),
        ("pools.delete_pool",),
        data=lambda: {"post": "yes"},
    ),
    Surface(
        "pause pools action",
        "post",
        lambda: reverse("admin:pools_pool_changelist"),
        ("pools.change_pool",),
        data=lambda: _action("pool", "pause_pools", lambda: [Pool.objects.get(name="spare").pk]),
        action=True,
    ),
    Surface(
        "cancel entries action",
        "post",
        lambda: reverse("admin:pools_queueentry_changelist"),
        ("pools.cancel_queueentry",),
        data=lambda: _action("queueentry", "cancel_entries", lambda: [_qid("w")]),
        action=True,
    ),
    Surface(
        "cancel and terminate action",
        "post",
        lambda: reverse("admin:pools_queueentry_changelist"),
        ("pools.cancel_queueentry",),
        data=lambda: _action("queueentry", "cancel_and_terminate", lambda: [_qid("run")]),
        action=True,
    ),
    Surface(
        "run now action",
        "post",
        lambda: reverse("admin:django_celery_beat_periodictask_changelist"),
        ("pools.start_job", "django_celery_beat.change_periodictask"),
        data=lambda: _action("periodictask", "run_now", lambda: [_job_pk()]),
        action=True,
    ),
]
POSTS = [s for s in SURFACES if s.method == "post"]


def by_name(surfaces: list[Surface]) -> Any:
    return pytest.mark.parametrize("surface", surfaces, ids=[s.name for s in surfaces])


@pytest.fixture
def rows(recorder):
    """``wh`` (1 slot): holder ``run`` and waiting ``w`` of run ``root-1``; ``spare``; a job."""
    make_pool("wh", 1)
    make_pool("spare", 2)
    submit("wh", key="run", root_id="root-1")
    submit("wh", key="w", root_id="root-1")
    every, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.HOURS)
    PeriodicTask.objects.create(
        name="nightly", task=add.name, interval=every, args=json.dumps([1, 2]), enabled=False
    )
    return recorder


def tables() -> tuple[Any, ...]:
    """Everything a refused request must leave as it was."""
    return (
        sorted(Pool.objects.values_list("name", "slots", "paused", "description")),
        sorted(QueueEntry.objects.values_list("key", "state", "token", "reason")),
        PoolEvent.objects.count(),
    )


def user_with(*perms: str, staff: bool = True) -> User:
    user = User.objects.create_user(f"u{User.objects.count() + 1}", password="pw", is_staff=staff)
    for perm in perms:
        app_label, codename = perm.split(".")
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label=app_label, codename=codename)
        )
    return User.objects.get(pk=user.pk)


def client_of(user: User | None, *, csrf: bool = False) -> Client:
    client = Client(enforce_csrf_checks=csrf)
    if user is not None:
        client.force_login(user)
    return client


def send(client: Client, surface: Surface) -> Any:
    return getattr(client, surface.method)(surface.path(), surface.data())


# --------------------------------------------------------------------------- who


@by_name(SURFACES)
def test_anonymous__is_sent_to_the_login_and_nothing_changes(rows, surface):
    before = tables()
    response = send(client_of(None), surface)
    assert response.status_code == 302 and response["Location"].startswith(LOGIN)
    assert tables() == before


@by_name(SURFACES)
def test_not_staff__is_sent_to_the_login_even_with_every_permission(rows, surface):
    before = tables()
    response = send(client_of(user_with(*PERMS, staff=False)), surface)
    assert response.status_code == 302 and response["Location"].startswith(LOGIN)
    assert tables() == before


@by_name(SURFACES)
def test_staff_without_the_permission__is_refused(rows, surface):
    others = [p for p in PERMS if p not in surface.perms]
    client = client_of(user_with(*others))
    before = tables()
    response = send(client, surface)
    if surface.action:
        # Not offered on the page, and a forged POST of it runs nothing.
        page = client.get(surface.path()).content.decode()
        assert f'value="{surface.data()["action"]}"' not in page
        assert response.status_code in (200, 302)
    else:
        assert response.status_code == 403
    assert tables() == before


@by_name([s for s in SURFACES if s.method == "get"])
def test_staff_with_one_of_its_permissions__may_look(rows, surface):
    """The control of the refusals: each page opens with the permission it names."""
    for perm in surface.perms:
        response = send(client_of(user_with(perm)), surface)
        assert response.status_code == 200, (perm, response.status_code)


# --------------------------------------------------------------------------- CSRF


@by_name(POSTS)
def test_post_without_csrf_token__is_403_and_nothing_changes(rows, surface):
    superuser = User.objects.create_superuser("root", password="pw")
    before = tables()
    response = send(client_of(superuser, csrf=True), surface)
    assert response.status_code == 403
    assert "CSRF" in response.content.decode()
    assert tables() == before


@by_name(POSTS)
def test_post_allowed__does_change_something(rows, surface):
    """The control of the CSRF and permission tests: the same POST, allowed, has an effect."""
    superuser = User.objects.create_superuser("root", password="pw")
    before = tables()
    response = send(client_of(superuser), surface)
    assert response.status_code in (200, 302)
    assert tables() != before


# --------------------------------------------------------------------------- the card


def test_index__shows_the_card_only_with_view_pool(rows):
    html = client_of(user_with("pools.view_queueentry")).get("/admin/").content.decode()
    assert 'id="pools-card"' not in html
    html = client_of(user_with("pools.view_pool")).get("/admin/").content.decode()
    assert 'id="pools-card"' in html
    # No cancel control without a cancel permission.
    assert 'class="pools-cancel"' not in html


# --------------------------------------------------------------------------- entries


def test_entry_detail__post_is_refused_rows_change_only_through_services(rows):
    """The change form is read-only: a POST would write the row outside the services."""
    superuser = User.objects.create_superuser("root", password="pw")
    before = tables()
    entry = QueueEntry.objects.get(key="w")
    response = client_of(superuser).post(
        reverse("admin:pools_queueentry_change", args=[entry.queue_id]), {}
    )
    assert response.status_code == 405
    assert tables() == before
    assert QueueEntry.objects.get(key="w").enqueued_at == entry.enqueued_at


HOSTILE = '<script>alert("x")</script>'


def test_hostile_key_and_task_name__are_escaped_everywhere(rows):
    make_pool("xss", 1)
    submit("xss", key=HOSTILE, root_id=HOSTILE)
    QueueEntry.objects.filter(key=HOSTILE).update(task_name=HOSTILE)
    submit("xss", key="after", root_id=HOSTILE)  # waiting behind it: shown in the card's head
    QueueEntry.objects.filter(key="after").update(task_name=HOSTILE)
    client = client_of(User.objects.create_superuser("root", password="pw"))
    pages = [
        "/admin/",
        reverse("admin:pools_pool_card"),
        reverse("admin:pools_queueentry_changelist"),
        reverse("admin:pools_queueentry_panel", args=[_qid("after")]),
        reverse("admin:pools_queueentry_change", args=[_qid("after")]),
        reverse("admin:pools_pool_occupancy", args=["xss"]),
    ]
    for page in pages:
        response = client.get(page)
        assert response.status_code == 200, page
        html = response.content.decode()
        assert "<script>alert" not in html, page
