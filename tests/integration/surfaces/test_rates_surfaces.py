"""Rate limits on the surfaces: REST input and snapshot, the admin form, ``pools list``."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.test import Client
from django.urls import reverse

from pools.core import rates
from pools.models import Pool, RateMark
from tests.support.admin import ADMIN_APPS
from tests.support.api import API_APPS, client_for, error, url
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

API = pytest.mark.django_db(transaction=True, available_apps=API_APPS)
ADMIN = pytest.mark.django_db(transaction=True, available_apps=ADMIN_APPS)


@API
def test_rest_pool_rate__round_trip_and_bad_input(recorder: RecordingBridge) -> None:
    client = client_for("pools.view_pool", "pools.add_pool", "pools.change_pool")
    body = {"name": "api", "slots": 4, "rate": "100/m"}
    status, got = error(client.post(url("pools/"), body, format="json"))
    assert status == 201 and got["rate"] == ["100/m"], got
    assert Pool.objects.get(name="api").rate == "100/m"
    changes = {"rate": ["10/s", "100000/d"]}
    status, got = error(client.patch(url("pools/api/"), changes, format="json"))
    assert status == 200 and got["rate"] == ["10/s", "100000/d"]
    # What GET shows can be sent back as it is.
    status, got = error(client.get(url("pools/api/")))
    status, again = error(client.patch(url("pools/api/"), {"rate": got["rate"]}, format="json"))
    assert status == 200 and again["rate"] == ["10/s", "100000/d"]
    status, got = error(client.patch(url("pools/api/"), {"rate": "10/x"}, format="json"))
    assert status == 400 and "'10/x' is not a rate; use N/s, N/m, N/h or N/d" in str(got["rate"])
    assert Pool.objects.get(name="api").rate == "10/s,100000/d"  # the refused change lost nothing
    status, got = error(client.patch(url("pools/api/"), {"rate": None}, format="json"))
    assert status == 200 and got["rate"] == []
    # A rate alone: starts are limited, slots are not.
    status, got = error(client.post(url("pools/"), {"name": "o", "rate": 5}, format="json"))
    assert status == 201 and (got["rate"], got["slots"]) == (["5/s"], rates.UNLIMITED_SLOTS)
    status, got = error(client.post(url("pools/"), {"name": "n"}, format="json"))
    assert status == 400 and "slots" in got


@ADMIN
def test_pool_admin__rate_is_saved_through_the_service(admin_client: Client) -> None:
    make_pool("wh", 1)
    pool = Pool.objects.get(name="wh")
    change = reverse("admin:pools_pool_change", args=[pool.pk])
    form = {
        "slots": "1",
        "max_queued": "",
        "description": "",
        "overflow": "reject",
        "paused_policy": "queue",
        "strategy": "priority",
        "aging_seconds": "",
        "rate": "10/x",
    }
    refused = admin_client.post(change, form)
    assert refused.status_code == 200
    assert "is not a rate; use N/s, N/m, N/h or N/d" in refused.content.decode()
    assert Pool.objects.get(name="wh").rate == ""
    form["rate"] = "10/s, 100000/d"
    admin_client.post(change, form, follow=True)
    assert Pool.objects.get(name="wh").rate == "10/s,100000/d"
    add = {**form, "name": "fresh", "rate": "30/m"}
    admin_client.post(reverse("admin:pools_pool_add"), add, follow=True)
    assert Pool.objects.get(name="fresh").rate == "30/m"


@API
def test_pools_list__shows_the_rate(recorder: RecordingBridge) -> None:
    make_pool("limited", 2, rate="100/m")
    make_pool("starts", rates.UNLIMITED_SLOTS, rate="10/s,100000/d")
    submit("starts", key="a")
    assert RateMark.objects.filter(pool__name="starts").count() == 2
    out = StringIO()
    call_command("pools", "list", stdout=out)
    text = out.getvalue()
    assert "(rate 100/m)" in text
    assert "1 held (no slot limit), 0 waiting (rate 10/s, 100000/d)" in text
