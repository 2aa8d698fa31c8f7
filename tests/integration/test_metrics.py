"""Prometheus metrics read from the database: values after a scripted scenario."""

from __future__ import annotations

import importlib.util

import pytest
from django.contrib.auth.models import User
from django.test import Client, override_settings
from django.utils import timezone

from pools import metrics
from pools.core import admission, definitions
from pools.models import QueueEntry
from tests.bridge import RecordingBridge
from tests.conftest import IN_CI
from tests.factories import make_pool, submit
from tests.integration.admin_support import ADMIN_APPS

pytestmark = pytest.mark.django_db(transaction=True, available_apps=ADMIN_APPS)

HAVE_CLIENT = importlib.util.find_spec("prometheus_client") is not None


def _scenario() -> None:
    make_pool("m", 2)
    submit("m", 2, key="big")  # admitted: holds both slots
    submit("m", 1, key="w1")
    submit("m", 1, key="w2")
    submit("m", 1, key="w3", queue_timeout=0.001)
    admission.cancel("w1")
    definitions.set_paused("m", True)  # nothing is admitted again below
    big = QueueEntry.objects.get(key="big")
    admission.requeue(big.queue_id, big.token, reason="lease lapsed", admit=False)
    # big is back in line; w2 waits; w3 expires.

    admission.expire_due(timezone.now())


def test_read__values_after_a_scripted_scenario(recorder: RecordingBridge) -> None:
    _scenario()
    (m,) = [p for p in metrics.read() if p.pool == "m"]
    assert (m.capacity, m.held, m.waiting, m.paused) == (2, 0, 2, True)
    assert m.admissions == 1
    assert m.lease_losses == 1
    assert m.refusals == {"cancelled": 1, "expired": 1}


@override_settings(ROOT_URLCONF="tests.integration.test_metrics")
def test_view__serves_the_exposition_to_users_allowed_to_view_pools(
    admin_client: Client, recorder: RecordingBridge
) -> None:
    if not HAVE_CLIENT:
        if IN_CI:
            pytest.fail("prometheus_client is not installed (the 'metrics' extra)")
        pytest.skip("prometheus_client is not installed (the 'metrics' extra)")
    _scenario()
    response = admin_client.get("/metrics/")
    assert response.status_code == 200
    text = response.content.decode()
    assert 'pools_capacity_slots{pool="m"} 2.0' in text
    assert 'pools_waiting_entries{pool="m"} 2.0' in text
    assert 'pools_admissions_total{pool="m"} 1.0' in text
    assert 'pools_lease_losses_total{pool="m"} 1.0' in text
    assert 'pools_refusals_total{pool="m",reason="expired"} 1.0' in text
    anonymous = Client().get("/metrics/")
    assert anonymous.status_code == 403
    User.objects.create_user("nobody", password="pw")
    nobody = Client()
    nobody.login(username="nobody", password="pw")
    assert nobody.get("/metrics/").status_code == 403


from django.urls import include, path  # noqa: E402  # the URLconf of the view test

urlpatterns = [path("metrics/", include("pools.metrics"))]
