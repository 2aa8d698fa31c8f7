"""REST API: reading pools and entries, pool create/update/delete, permissions, CSRF, cost."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone
from pytest_django import DjangoAssertNumQueries
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from pools.core import admission
from pools.models import Demand, Pool, QueueEntry
from pools.states import EntryState
from tests.support.api import API_APPS, client_for, error, make_user, url
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = pytest.mark.django_db(transaction=True, available_apps=API_APPS)

VIEW = "pools.view_pool"


@pytest.fixture
def reader() -> APIClient:
    return client_for(VIEW)


def bulk_waiting(pool: Pool, count: int) -> None:
    base = timezone.now() - timedelta(hours=1)
    entries = QueueEntry.objects.bulk_create(
        QueueEntry(
            key=f"bulk-{pool.name}-{i}",
            task_name="tests.fake",
            demand={pool.name: 1},
            priority=i % 3,
            enqueued_at=base + timedelta(milliseconds=i),
        )
        for i in range(count)
    )
    Demand.objects.bulk_create(
        Demand(entry=e, pool=pool, slots=1, priority=e.priority, enqueued_at=e.enqueued_at)
        for e in entries
    )


# --------------------------------------------------------------------------- reads


def test_get_pools__lists_capacity_occupancy_head_and_recent(
    recorder: RecordingBridge, reader: APIClient
) -> None:
    make_pool("p", 2)
    for k in ("a", "b", "c", "d"):
        submit("p", key=k, priority=1 if k == "d" else 0)
    submit("p", key="gone")
    admission.cancel("gone")
    status, body = error(reader.get(url("pools/")))
    assert status == 200
    p = next(x for x in body if x["name"] == "p")
    assert {k: p[k] for k in ("slots", "capacity", "held", "free", "paused", "max_queued")} == {
        "slots": 2,
        "capacity": 2,
        "held": 2,
        "free": 0,
        "paused": False,
        "max_queued": None,
    }
    assert p["counts"] == {"waiting": 2, "admitted": 2, "running": 0}
    assert [r["key"] for r in p["running"]] == ["a", "b"]
    assert [(w["key"], w["position"], w["blocked_by"]) for w in p["waiting"]] == [
        ("d", 1, "pool_full"),
        ("c", 2, "pool_full"),
    ]
    assert p["waiting"][0]["priority"] == 1 and "message" in p["waiting"][0]
    assert [(r["key"], r["state"], r["reason"]) for r in p["recent"]] == [
        ("gone", "cancelled", "cancelled")
    ]
    assert {x["name"] for x in body} >= {"p", "warehouse", "partner-api"}


def test_get_pool__detail_and_unknown(recorder: RecordingBridge, reader: APIClient) -> None:
    make_pool("p", 1)
    submit("p", key="run")
    status, body = error(reader.get(url("pools/p/")))
    assert status == 200 and body["name"] == "p" and body["held"] == 1
    assert body["running"][0]["key"] == "run" and body["running"][0]["state"] == "admitted"
    status, body = error(reader.get(url("pools/nope/")))
    assert status == 404
    assert body == {"detail": body["detail"], "code": "unknown_pool"}
    assert "'nope' does not exist" in body["detail"]


def test_get_entries__cursor_pages_in_line_order(
    recorder: RecordingBridge, reader: APIClient
) -> None:
    pool = make_pool("p", 1)
    submit("p", key="run")
    bulk_waiting(pool, 7)
    line = list(Demand.objects.line(pool.pk).values_list("entry__key", flat=True))
    seen: list[tuple[str, int]] = []
    next_url = url("pools/p/entries/?state=waiting&limit=3")
    while next_url:
        status, body = error(reader.get(next_url))
        assert status == 200
        seen.extend((r["key"], r["position"]) for r in body["results"])
        next_url = body["next"]
    assert seen == [(k, i + 1) for i, k in enumerate(line)]
    status, body = error(reader.get(url("pools/p/entries/?state=admitted")))
    assert [r["key"] for r in body["results"]] == ["run"] and body["next"] is None


@pytest.mark.parametrize(
    "query,field",
    [
        ("state=sleeping", "detail"),
        ("limit=0", "limit"),
        ("limit=x", "limit"),
        ("cursor=@@", "detail"),
    ],
)
def test_get_entries__bad_parameters_are_400(
    recorder: RecordingBridge, reader: APIClient, query: str, field: str
) -> None:
    make_pool("p", 1)
    status, body = error(reader.get(url(f"pools/p/entries/?{query}")))
    assert status == 400 and field in body


def test_get_entries__unknown_pool_is_404(reader: APIClient) -> None:
    status, body = error(reader.get(url("pools/nope/entries/")))
    assert (status, body["code"]) == (404, "unknown_pool")


def test_get_entry__why_it_waits(recorder: RecordingBridge, reader: APIClient) -> None:
    make_pool("p", 1)
    submit("p", key="run")
    submit("p", key="w")
    status, body = error(reader.get(url("entries/w/")))
    assert status == 200
    assert (body["key"], body["state"], body["blocked_by"], body["eta"]) == (
        "w",
        "waiting",
        "pool_full",
        None,
    )
    (place,) = body["pools"]
    assert (place["pool"], place["position"], place["blocked_by"]) == ("p", 1, "pool_full")
    assert place["detail"]["holders"] == [
        {"queue_id": place["detail"]["holders"][0]["queue_id"], "key": "run"}
    ]
    assert place["message"].startswith("Pool 'p' is full: 1 of 1 slot(s) held by #")
    status, body = error(reader.get(url("entries/nope/")))
    assert (status, body["code"]) == (404, "entry_not_found")


# --------------------------------------------------------------------------- query counts


def _get_pools_queries(
    client: APIClient, django_assert_max_num_queries: DjangoAssertNumQueries, bound: int
) -> None:
    with django_assert_max_num_queries(bound):
        assert client.get(url("pools/")).status_code == 200


#: Queries of authentication and permissions: session, user, user and group permissions.
AUTH = 4
#: The read's bound on PostgreSQL: BEGIN, SET LOCAL lock/statement timeout, COMMIT.
BOUND = 3 if connection.vendor == "postgresql" else 0
#: Queries of each answer: the snapshot of every pool, 5 whatever the depth and pool count.
GET_POOLS_QUERIES = AUTH + BOUND + 5
#: A page: pool, rows, first row, position, holders, hold times (+ other pools' gates).
GET_ENTRIES_QUERIES = AUTH + BOUND + 7
#: The entry, its demands, holders, hold times, then position and head per pool.
GET_ENTRY_QUERIES = AUTH + BOUND + 1 + 3 + 2


@pytest.mark.parametrize("depth", [3, 600])
def test_queries__get_pools_is_bounded_whatever_the_depth(
    recorder: RecordingBridge,
    reader: APIClient,
    depth: int,
    django_assert_max_num_queries: DjangoAssertNumQueries,
) -> None:
    for i in range(8):
        pool = make_pool(f"q{i}", 1)
        submit(pool.name, key=f"run-{i}")
        bulk_waiting(pool, depth)
    submit({"q0": 1, "q1": 1}, key="multi")
    _get_pools_queries(reader, django_assert_max_num_queries, GET_POOLS_QUERIES)
    with django_assert_max_num_queries(GET_POOLS_QUERIES):
        assert reader.get(url("pools/q3/")).status_code == 200


@pytest.mark.parametrize("depth", [3, 600])
def test_queries__get_entries_and_entry_are_bounded(
    recorder: RecordingBridge,
    reader: APIClient,
    depth: int,
    django_assert_max_num_queries: DjangoAssertNumQueries,
) -> None:
    pool = make_pool("p", 1)
    submit("p", key="run")
    bulk_waiting(pool, depth)
    submit("p", key="last")
    first = reader.get(url("pools/p/entries/?limit=2")).json()
    with django_assert_max_num_queries(GET_ENTRIES_QUERIES):
        page = reader.get(first["next"]).json()
    assert [r["position"] for r in page["results"]] == [3, 4]
    with django_assert_max_num_queries(GET_ENTRY_QUERIES):
        body = reader.get(url("entries/last/")).json()
    assert body["pools"][0]["position"] == depth + 1


# --------------------------------------------------------------------------- create/update/delete


def test_post_pools__creates_with_the_rules_of_settings(recorder: RecordingBridge) -> None:
    client = client_for(VIEW, "pools.add_pool")
    status, body = error(client.post(url("pools/"), {"name": "new", "slots": 3}, format="json"))
    assert status == 201 and (body["name"], body["slots"], body["free"]) == ("new", 3, 3)
    assert Pool.objects.get(name="new").defined_in_settings is False
    status, body = error(
        client.post(url("pools/"), {"name": "bad name!", "slots": 0}, format="json")
    )
    assert status == 400 and set(body) == {"name", "slots"}
    assert "Invalid pool name" in body["name"][0]
    assert "positive integer" in body["slots"][0]
    status, body = error(client.post(url("pools/"), {"name": "new", "slots": 1}, format="json"))
    assert status == 400 and "already exists" in body["name"][0]


def test_patch_pool__changes_capacity_and_admits(recorder: RecordingBridge) -> None:
    client = client_for(VIEW, "pools.change_pool")
    make_pool("p", 1)
    submit("p", key="run")
    submit("p", key="next")
    status, body = error(client.patch(url("pools/p/"), {"slots": 2}, format="json"))
    # "next" was queued before the change: it drains at the old capacity (SPEC §6).
    assert status == 200 and (body["slots"], body["capacity"], body["draining"]) == (2, 1, True)
    assert QueueEntry.objects.get(key="next").state == EntryState.WAITING
    run = QueueEntry.objects.get(key="run")
    assert admission.settle(run.queue_id, run.token, EntryState.SUCCEEDED)
    assert QueueEntry.objects.get(key="next").state == EntryState.ADMITTED
    status, body = error(client.get(url("pools/p/")))
    assert (body["slots"], body["capacity"], body["draining"]) == (2, 2, False)
    status, body = error(client.patch(url("pools/p/"), {"overflow": "drop_oldest"}, format="json"))
    assert status == 200 and body["overflow"] == "drop_oldest"
    status, body = error(client.patch(url("pools/p/"), {"overflow": "drop_all"}, format="json"))
    assert status == 400 and "overflow" in body
    status, body = error(client.patch(url("pools/p/"), {"slots": -1}, format="json"))
    assert status == 400 and "slots" in body
    status, body = error(client.patch(url("pools/p/"), {"name": "q"}, format="json"))
    assert status == 400 and "cannot be renamed" in body["name"][0]
    status, body = error(client.patch(url("pools/nope/"), {"slots": 2}, format="json"))
    assert (status, body["code"]) == (404, "unknown_pool")
    status, body = error(client.patch(url("pools/p/"), {"paused": True}, format="json"))
    assert status == 200 and body["paused"] is True
    status, body = error(client.patch(url("pools/p/"), {"strategy": "fair"}, format="json"))
    assert status == 200 and (body["strategy"], body["aging_seconds"]) == ("fair", None)
    status, body = error(client.patch(url("pools/p/"), {"aging_seconds": 30}, format="json"))
    assert status == 400 and "aging_seconds" in str(body), body
    changes = {"strategy": "priority", "aging_seconds": 30}
    status, body = error(client.patch(url("pools/p/"), changes, format="json"))
    assert status == 200 and (body["strategy"], body["aging_seconds"]) == ("priority", 30)
    status, body = error(client.patch(url("pools/p/"), {"strategy": "random"}, format="json"))
    assert status == 400 and "strategy" in body
    status, body = error(client.patch(url("pools/p/"), {"spend_cap": 3600}, format="json"))
    assert status == 200 and (body["spend_cap"], body["spent_today"]) == (3600.0, 0.0)
    status, body = error(client.patch(url("pools/p/"), {"spend_cap": -5}, format="json"))
    assert status == 400 and "slot-seconds" in str(body["spend_cap"]), body
    assert Pool.objects.get(name="p").spend_cap == 3600.0  # the refused change lost nothing
    status, body = error(client.patch(url("pools/p/"), {"spend_cap": None}, format="json"))
    assert status == 200 and body["spend_cap"] is None


def test_delete_pool__refused_while_in_use_or_defined_in_settings(
    recorder: RecordingBridge,
) -> None:
    client = client_for(VIEW, "pools.delete_pool")
    make_pool("p", 1)
    submit("p", key="run")
    submit("p", key="w")
    status, body = error(client.delete(url("pools/p/")))
    assert (status, body["code"]) == (409, "pool_in_use")
    assert "2 unfinished entries" in body["detail"]
    status, body = error(client.delete(url("pools/warehouse/")))
    assert (status, body["code"]) == (409, "pool_defined_in_settings")
    assert "POOLS['DEFINITIONS']" in body["detail"]
    admission.cancel("w")
    admission.cancel("run", terminate=True)
    adm = QueueEntry.objects.get(key="run")
    assert admission.settle(adm.queue_id, adm.token, EntryState.CANCELLED)
    response = client.delete(url("pools/p/"))
    assert response.status_code == 204
    assert not Pool.objects.filter(name="p").exists()
    assert QueueEntry.objects.filter(key="w").exists(), "finished entries stay"
    status, body = error(client.delete(url("pools/p/")))
    assert (status, body["code"]) == (404, "unknown_pool")


# --------------------------------------------------------------------------- permissions, auth


ENDPOINTS = [
    ("get", "pools/", None),
    ("get", "pools/warehouse/", None),
    ("get", "pools/warehouse/entries/", None),
    ("get", "entries/k/", None),
    ("post", "pools/", {"name": "x", "slots": 1}),
    ("patch", "pools/warehouse/", {"slots": 2}),
    ("delete", "pools/warehouse/", None),
    ("post", "pools/warehouse/queue/k/cancel", {}),
    ("post", "jobs/j/start", {}),
]


@pytest.mark.parametrize("method,path,data", ENDPOINTS)
def test_permissions__anonymous_and_unpermitted_users_are_refused(
    method: str, path: str, data: dict[str, Any] | None
) -> None:
    status, body = error(getattr(APIClient(), method)(url(path), data, format="json"))
    assert (status, body["code"]) == (403, "not_authenticated")
    # A user with every permission but the one this endpoint needs; staff is not enough.
    needed = {
        "get": "pools.view_pool",
        "post": {"pools/": "pools.add_pool", "jobs/j/start": "pools.start_job"}.get(
            path, "pools.cancel_queueentry"
        ),
        "patch": "pools.change_pool",
        "delete": "pools.delete_pool",
    }[method]
    from tests.support.api import ALL_PERMS

    client = APIClient()
    client.force_login(make_user(*(p for p in ALL_PERMS if p != needed), staff=True))
    status, body = error(getattr(client, method)(url(path), data, format="json"))
    assert (status, body["code"]) == (403, "permission_denied")


def test_permissions__permitted_user_with_a_token(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    user = make_user(VIEW)
    token = Token.objects.create(user=user)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    assert client.get(url("pools/p/")).status_code == 200
    client.credentials(HTTP_AUTHORIZATION="Token wrong")
    status, body = error(client.get(url("pools/p/")))
    assert (status, body["code"]) == (403, "authentication_failed")


def test_csrf__session_post_without_token_is_refused(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    submit("p", key="run")
    submit("p", key="w")
    client = client_for(VIEW, "pools.cancel_queueentry", csrf=True)
    status, body = error(client.post(url("pools/p/queue/w/cancel"), {}, format="json"))
    assert status == 403 and "CSRF" in body["detail"]
    assert QueueEntry.objects.get(key="w").state == EntryState.WAITING
    # With the token from the cookie the same request passes.
    client.get(url("pools/p/"))  # any page; the CSRF cookie is set by the login below
    from django.middleware.csrf import (  # type: ignore[attr-defined]  # private, not in stubs
        _get_new_csrf_string,
        _mask_cipher_secret,
    )

    secret = _get_new_csrf_string()
    client.cookies["csrftoken"] = secret
    response = client.post(
        url("pools/p/queue/w/cancel"),
        {},
        format="json",
        HTTP_X_CSRFTOKEN=_mask_cipher_secret(secret),
    )
    assert response.status_code == 200, response.content
    assert QueueEntry.objects.get(key="w").state == EntryState.CANCELLED
