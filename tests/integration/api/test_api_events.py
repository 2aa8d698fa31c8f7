"""``GET events/`` (the audit trail in the REST API) and where the admin shows the log."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.http import QueryDict
from django.test import Client
from django.urls import reverse
from rest_framework.test import APIClient

from pools import permissions
from pools.core import admission, capacity, pool_crud
from pools.models import PoolEvent
from pools.states import EventKind
from tests.support.admin import ADMIN_APPS
from tests.support.api import client_for, make_user, url
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = pytest.mark.django_db(transaction=True, available_apps=ADMIN_APPS)

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def _event(kind: str, pool: str, minute: int, *, key: str = "", actor: str = "") -> PoolEvent:
    return PoolEvent.objects.create(
        kind=kind, pool=pool, key=key, actor=actor, at=T0 + timedelta(minutes=minute)
    )


@pytest.fixture
def log() -> list[PoolEvent]:
    """Six rows, one a minute from T0: two pools, two keys, two actors, three kinds."""
    return [
        _event(EventKind.POOL_CREATED, "wh", 0, actor="ann"),
        _event(EventKind.CANCELLED, "wh", 1, key="k1", actor="ann"),
        _event(EventKind.CANCELLED, "api", 2, key="k2", actor="bob"),
        _event(EventKind.CAPACITY_CHANGED, "wh", 3, actor="bob"),
        _event(EventKind.EXPIRED, "wh", 4, key="k1"),
        _event(EventKind.CANCELLED, "wh", 5, key="k3", actor="ann"),
    ]


def _ids(response: Any) -> list[int]:
    assert response.status_code == 200, response.content
    return [row["id"] for row in response.json()["results"]]


def _get(query: str = "") -> Any:
    return client_for(permissions.VIEW_EVENT).get(url(f"events/{query}"))


def test_list__newest_first_with_every_field(log):
    response = _get()
    assert _ids(response) == [e.id for e in reversed(log)]
    first = response.json()["results"][0]
    assert set(first) == {"id", "at", "kind", "pool", "entry_id", "key", "token", "actor", "detail"}
    assert (first["kind"], first["pool"], first["key"], first["actor"]) == (
        "cancelled",
        "wh",
        "k3",
        "ann",
    )
    assert response.json()["next"] is None and response.json()["next_cursor"] is None


@pytest.mark.parametrize(
    "query,picked",
    [
        ("?pool=api", [2]),
        ("?key=k1", [4, 1]),
        ("?actor=bob", [3, 2]),
        ("?kind=cancelled", [5, 2, 1]),
        ("?kind=cancelled&kind=expired", [5, 4, 2, 1]),
        ("?pool=wh&actor=ann&kind=cancelled", [5, 1]),
        ("?since=2026-01-01T12:03:00Z", [5, 4, 3]),
        ("?until=2026-01-01T12:02:00Z", [1, 0]),
        ("?since=2026-01-01T12:01:00Z&until=2026-01-01T12:04:00Z&pool=wh", [3, 1]),
        ("?pool=none", []),
    ],
)
def test_filters__select_exactly_the_matching_rows(log, query, picked):
    assert _ids(_get(query)) == [log[i].id for i in picked]


@pytest.mark.parametrize(
    "query,field",
    [
        ("?kind=nope", "kind"),
        ("?since=yesterday", "since"),
        ("?until=2026-13-45", "until"),
        ("?limit=0", "limit"),
        ("?limit=many", "limit"),
        ("?pool=a%00b", "pool"),
        ("?key=%00", "key"),
    ],
)
def test_bad_filters__answer_400_per_field(log, query, field):
    response = _get(query)
    assert response.status_code == 400
    assert field in response.json()


def test_cursor__pages_cover_the_log_once_in_order_keeping_the_filters(log):
    client = client_for(permissions.VIEW_EVENT)
    response = client.get(url("events/?pool=wh&limit=2"))
    seen = _ids(response)
    pages = 1
    while response.json()["next"]:
        assert "pool=wh" in response.json()["next"] and "limit=2" in response.json()["next"]
        response = client.get(response.json()["next"])
        seen += _ids(response)
        pages += 1
    assert seen == [e.id for e in reversed(log) if e.pool == "wh"]
    assert pages == 3  # 5 rows, 2 a page


def test_cursor__rows_written_after_the_first_page_do_not_shift_the_next_ones(log):
    client = client_for(permissions.VIEW_EVENT)
    first = client.get(url("events/?limit=3")).json()
    _event(EventKind.CANCELLED, "wh", 9, key="late")
    rest = client.get(url(f"events/?limit=3&cursor={first['next_cursor']}"))
    assert _ids(rest) == [log[2].id, log[1].id, log[0].id]


@pytest.mark.parametrize("cursor", ["!!!", "bm90LWpzb24", "WyJzdGF0ZSIsIDFd"])
def test_cursor__one_not_made_by_the_endpoint_is_400_invalid_cursor(log, cursor):
    response = _get(f"?cursor={cursor}")
    assert response.status_code == 400
    assert response.json()["code"] == "invalid_cursor"


def test_permission__view_pool_is_not_enough_and_the_refusal_says_what_is(log):
    response = client_for("pools.view_pool").get(url("events/"))
    assert response.status_code == 403
    assert response.json()["code"] == "permission_denied"
    assert permissions.VIEW_EVENT in response.json()["detail"]


def test_permission__anonymous_is_refused(log):
    assert APIClient().get(url("events/")).status_code == 403


def test_real_changes__are_listed_with_their_actor(recorder: RecordingBridge):
    pool_crud.create_pool(name="real", slots=1, actor="ann")
    capacity.set_paused("real", True, actor="bob")
    submit("real", key="wait")
    admission.cancel("wait", actor="carol")
    rows = _get("?pool=real").json()["results"]
    assert [(r["kind"], r["actor"]) for r in rows] == [
        ("cancelled", "carol"),
        ("capacity", "bob"),
        ("pool_created", "ann"),
    ]
    assert rows[0]["key"] == "wait" and rows[0]["entry_id"] is not None


def test_schema__lists_the_endpoint_and_its_filters():
    from drf_spectacular.generators import SchemaGenerator

    op = SchemaGenerator().get_schema(request=None, public=True)["paths"]["/api/events/"]["get"]
    names = {p["name"] for p in op["parameters"]}
    assert {"pool", "key", "actor", "kind", "since", "until", "limit", "cursor"} <= names
    assert {"200", "400", "403", "503"} <= set(op["responses"])


# --------------------------------------------------------------------------- admin


def _admin(*perms: str) -> Client:
    client = Client()
    client.force_login(make_user(*perms, staff=True))
    return client


def test_admin_event_list__has_the_key_column_and_filters_by_pool(log):
    client = _admin(permissions.VIEW_EVENT)
    html = client.get(reverse("admin:pools_poolevent_changelist") + "?pool=wh").content.decode()
    assert "column-key" in html
    assert "k1" in html and "k3" in html and "k2" not in html


def test_card__links_each_pool_to_its_events_with_the_permission(recorder: RecordingBridge):
    make_pool("wh", 1)
    events = reverse("admin:pools_poolevent_changelist")
    html = _admin("pools.view_pool", permissions.VIEW_EVENT).get("/admin/").content.decode()
    assert f'href="{events}?pool=wh"' in html
    html = _admin("pools.view_pool").get("/admin/").content.decode()
    assert f'href="{events}?pool=wh"' not in html


@pytest.mark.parametrize("page", ["occupancy", "change form"])
def test_pool_pages__link_to_the_pools_events_with_the_permission(recorder, page):
    pool = make_pool("wh", 1)
    path = (
        reverse("admin:pools_pool_occupancy", args=["wh"])
        if page == "occupancy"
        else reverse("admin:pools_pool_change", args=[pool.pk])
    )
    events = reverse("admin:pools_poolevent_changelist") + "?pool=wh"
    allowed = _admin("pools.view_pool", permissions.VIEW_EVENT).get(path)
    assert allowed.status_code == 200
    assert f'href="{events}"' in allowed.content.decode()
    plain = _admin("pools.view_pool").get(path)
    assert plain.status_code == 200
    assert f'href="{events}"' not in plain.content.decode()


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("field", "index"), [("key", "pools_event_key"), ("actor", "pools_event_actor")]
)
def test_key_and_actor_filters__are_served_by_their_partial_index(field, index):
    """A log of engine rows (no key, no actor) plus a few with one: the API's filter by key
    or actor, newest first, reads its partial index, without a sort of the matches.
    Sequential scans are off so the check does not depend on the table's size."""
    from django.db import connection

    from pools.api import events as events_api

    PoolEvent.objects.bulk_create(
        PoolEvent(kind=EventKind.REQUEUED, pool="wh", at=T0) for _ in range(2000)
    )
    _event(EventKind.CANCELLED, "wh", 1, key="k1", actor="ann")
    rows = events_api.filtered(QueryDict(f"{field}=" + ("k1" if field == "key" else "ann")))
    with connection.cursor() as cur:
        cur.execute("ANALYZE pools_poolevent")
        cur.execute("SET enable_seqscan = off")
    try:
        plan = str(rows.order_by("-id")[:51].explain())
    finally:
        with connection.cursor() as cur:
            cur.execute("RESET enable_seqscan")
    assert index in plan, plan
    assert "Sort" not in plan, plan
