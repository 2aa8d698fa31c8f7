"""REST API security review: every endpoint refuses every caller it should, and changes nothing.

One test per refusal and endpoint (docs/reference/security.md has the table):

- anonymous (no credentials, a wrong token, wrong basic credentials, an inactive user),
- logged in without the endpoint's permission (a plain user with no permission at all),
- staff holding every other pool permission but the one the endpoint needs,
- a session-authenticated write without the CSRF token (token and basic authentication
  carry no ambient credential and need none).

Every refusal is JSON with a ``code``, and a refused write leaves the tables as they were.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.middleware.csrf import (  # type: ignore[attr-defined]  # private helpers
    _get_new_csrf_string,
    _mask_cipher_secret,
)
from django_celery_beat.models import IntervalSchedule, PeriodicTask
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from pools.models import Pool, PoolEvent, QueueEntry
from tests.support.api import ALL_PERMS, API_APPS, error, make_user, url
from tests.support.factories import make_pool, submit
from tests.testapp.tasks import add

pytestmark = pytest.mark.django_db(transaction=True, available_apps=API_APPS)

#: (method, path, body, the one permission it needs). Paths name the fixture's rows.
ENDPOINTS: list[tuple[str, str, Any, str]] = [
    ("get", "pools/", None, "pools.view_pool"),
    ("get", "pools/wh/", None, "pools.view_pool"),
    ("get", "pools/wh/entries/", None, "pools.view_pool"),
    ("get", "entries/w/", None, "pools.view_pool"),
    ("post", "pools/", {"name": "new", "slots": 1}, "pools.add_pool"),
    ("patch", "pools/spare/", {"slots": 5, "paused": True}, "pools.change_pool"),
    ("delete", "pools/spare/", None, "pools.delete_pool"),
    ("post", "pools/spare/pause", None, "pools.change_pool"),
    ("post", "pools/wh/resume", None, "pools.change_pool"),
    ("post", "pools/wh/queue/w/cancel", {}, "pools.cancel_queueentry"),
    ("post", "jobs/nightly/start", None, "pools.start_job"),
    ("get", "events/", None, "pools.view_poolevent"),
]
WRITES = [e for e in ENDPOINTS if e[0] != "get"]
IDS = [f"{m.upper()} {p}" for m, p, _, _ in ENDPOINTS]
WRITE_IDS = [f"{m.upper()} {p}" for m, p, _, _ in WRITES]


@pytest.fixture
def rows(recorder):
    """``wh`` (1 slot) with a holder and a waiting entry ``w``, an idle ``spare``, a job."""
    make_pool("wh", 1)
    make_pool("spare", 2)
    submit("wh", key="run")
    submit("wh", key="w")
    every, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.HOURS)
    PeriodicTask.objects.create(
        name="nightly", task=add.name, interval=every, args=json.dumps([1, 2]), enabled=False
    )
    return recorder


def tables() -> tuple[Any, ...]:
    """Everything a refused request must leave as it was."""
    return (
        sorted(Pool.objects.values_list("name", "slots", "paused", "max_queued")),
        sorted(QueueEntry.objects.values_list("key", "state", "token")),
        PoolEvent.objects.count(),
    )


def call(client: APIClient, method: str, path: str, body: Any, **extra: Any) -> Any:
    return getattr(client, method)(url(path), body, format="json", **extra)


def refused(response: Any, status: int, code: str) -> None:
    got_status, got = error(response)
    assert (got_status, got.get("code")) == (status, code), got
    assert got["detail"], "a refusal says why"


# --------------------------------------------------------------------------- anonymous


@pytest.mark.parametrize("method,path,body,perm", ENDPOINTS, ids=IDS)
def test_anonymous__is_refused_and_nothing_changes(rows, method, path, body, perm):
    before = tables()
    refused(call(APIClient(), method, path, body), 403, "not_authenticated")
    assert tables() == before


@pytest.mark.parametrize("method,path,body,perm", ENDPOINTS, ids=IDS)
def test_wrong_token__is_refused_and_nothing_changes(rows, method, path, body, perm):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token 0123456789abcdef0123456789abcdef01234567")
    before = tables()
    refused(call(client, method, path, body), 403, "authentication_failed")
    assert tables() == before


@pytest.mark.parametrize("method,path,body,perm", ENDPOINTS, ids=IDS)
def test_wrong_password__basic_auth_is_refused(rows, method, path, body, perm):
    user = make_user(*ALL_PERMS)
    client = APIClient()
    basic = base64.b64encode(f"{user.username}:not-the-password".encode()).decode()
    client.credentials(HTTP_AUTHORIZATION=f"Basic {basic}")
    before = tables()
    refused(call(client, method, path, body), 403, "authentication_failed")
    assert tables() == before


@pytest.mark.parametrize(
    "header",
    [
        "Basic " + base64.b64encode(b"root\x00:pw").decode(),
        "Token abc\x00def",
    ],
    ids=["nul-in-basic-name", "nul-in-token"],
)
def test_nul_byte_in_credentials__is_refused_not_a_500(rows, header):
    """Found by the fuzzer: PostgreSQL refuses a NUL byte in the user lookup (DataError)."""
    User.objects.create_user("root", password="pw")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=header)
    before = tables()
    refused(client.get(url("pools/")), 403, "authentication_failed")
    refused(call(client, "patch", "pools/spare/", {"slots": 9}), 403, "authentication_failed")
    assert tables() == before


@pytest.mark.parametrize("method,path,body,perm", WRITES, ids=WRITE_IDS)
def test_inactive_user__token_is_refused(rows, method, path, body, perm):
    user = make_user(*ALL_PERMS)
    token = Token.objects.create(user=user)
    User.objects.filter(pk=user.pk).update(is_active=False)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    before = tables()
    refused(call(client, method, path, body), 403, "authentication_failed")
    assert tables() == before


# --------------------------------------------------------------------------- permissions


@pytest.mark.parametrize("method,path,body,perm", ENDPOINTS, ids=IDS)
def test_logged_in_without_any_permission__is_refused(rows, method, path, body, perm):
    client = APIClient()
    client.force_login(make_user())
    before = tables()
    refused(call(client, method, path, body), 403, "permission_denied")
    assert tables() == before


@pytest.mark.parametrize("method,path,body,perm", ENDPOINTS, ids=IDS)
def test_staff_without_the_permission__is_refused(rows, method, path, body, perm):
    client = APIClient()
    client.force_login(make_user(*(p for p in ALL_PERMS if p != perm), staff=True))
    before = tables()
    response = call(client, method, path, body)
    refused(response, 403, "permission_denied")
    assert perm in response.json()["detail"], "the refusal names the permission it needs"
    assert tables() == before


@pytest.mark.parametrize("method,path,body,perm", WRITES, ids=WRITE_IDS)
def test_write_permission_alone__is_enough(rows, method, path, body, perm):
    """The control of the two tests above: the one permission lets the request through."""
    client = APIClient()
    client.force_login(make_user(perm))
    response = call(client, method, path, body)
    assert response.status_code in (200, 201, 202, 204), response.content
    assert tables() != (), "the fixture has rows"


# --------------------------------------------------------------------------- CSRF


def _session_client(*perms: str) -> APIClient:
    client = APIClient(enforce_csrf_checks=True)
    client.force_login(make_user(*perms))
    return client


@pytest.mark.parametrize("method,path,body,perm", WRITES, ids=WRITE_IDS)
def test_session_write_without_csrf_token__is_refused(rows, method, path, body, perm):
    client = _session_client(*ALL_PERMS)
    before = tables()
    response = call(client, method, path, body)
    refused(response, 403, "permission_denied")
    assert "CSRF" in response.json()["detail"]
    assert tables() == before


@pytest.mark.parametrize("method,path,body,perm", WRITES, ids=WRITE_IDS)
def test_session_write_with_a_forged_csrf_token__is_refused(rows, method, path, body, perm):
    client = _session_client(*ALL_PERMS)
    client.cookies["csrftoken"] = _get_new_csrf_string()
    before = tables()
    forged = _mask_cipher_secret(_get_new_csrf_string())  # another secret than the cookie's
    response = call(client, method, path, body, HTTP_X_CSRFTOKEN=forged)
    refused(response, 403, "permission_denied")
    assert "CSRF" in response.json()["detail"]
    assert tables() == before


@pytest.mark.parametrize("method,path,body,perm", WRITES, ids=WRITE_IDS)
def test_session_write_with_the_csrf_token__passes(rows, method, path, body, perm):
    """The control: the same request with the cookie's token goes through."""
    client = _session_client(*ALL_PERMS)
    secret = _get_new_csrf_string()
    client.cookies["csrftoken"] = secret
    response = call(client, method, path, body, HTTP_X_CSRFTOKEN=_mask_cipher_secret(secret))
    assert response.status_code in (200, 201, 202, 204), response.content


@pytest.mark.parametrize("method,path,body,perm", WRITES, ids=WRITE_IDS)
def test_token_write__needs_no_csrf_token(rows, method, path, body, perm):
    token = Token.objects.create(user=make_user(perm))
    client = APIClient(enforce_csrf_checks=True)
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    response = call(client, method, path, body)
    assert response.status_code in (200, 201, 202, 204), response.content


def test_unknown_method__is_405_json_and_changes_nothing(rows):
    """PUT is not an endpoint's method: 405 for any signed-in user, 403 for anonymous."""
    status, body = error(APIClient().put(url("pools/wh/"), {"slots": 3}, format="json"))
    assert (status, body["code"]) == (403, "not_authenticated")
    client = APIClient()
    client.force_login(make_user())
    status, body = error(client.put(url("pools/wh/"), {"slots": 3}, format="json"))
    assert (status, body["code"]) == (405, "method_not_allowed")
    assert Pool.objects.get(name="wh").slots == 1
