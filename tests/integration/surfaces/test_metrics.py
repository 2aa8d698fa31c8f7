"""Prometheus metrics read from the database: values after a scripted scenario."""

from __future__ import annotations

import importlib.util

import pytest
from django.contrib.auth.models import User
from django.test import Client, override_settings
from django.utils import timezone

from pools import metrics
from pools.core import admission, budgets, capacity
from pools.models import QueueEntry
from tests.conftest import IN_CI
from tests.support.admin import ADMIN_APPS
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = pytest.mark.django_db(transaction=True, available_apps=ADMIN_APPS)

HAVE_CLIENT = importlib.util.find_spec("prometheus_client") is not None


def _scenario() -> None:
    make_pool("m", 2)
    submit("m", 2, key="big")  # admitted: holds both slots
    submit("m", 1, key="w1")
    submit("m", 1, key="w2")
    submit("m", 1, key="w3", queue_timeout=0.001)
    admission.cancel("w1")
    capacity.set_paused("m", True)  # nothing is admitted again below
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


@override_settings(ROOT_URLCONF="tests.integration.surfaces.test_metrics")
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
    # "big" was admitted at once: one wait, in the first bucket (a gauge histogram).
    assert 'pools_wait_seconds_bucket{le="0.01",pool="m"} 1.0' in text
    assert 'pools_wait_seconds_gcount{pool="m"} 1.0' in text
    anonymous = Client().get("/metrics/")
    assert anonymous.status_code == 403
    User.objects.create_user("nobody", password="pw")
    nobody = Client()
    nobody.login(username="nobody", password="pw")
    assert nobody.get("/metrics/").status_code == 403


def _budget_and_spend_scenario() -> None:
    """A run stopped by its cost budget; a pool with a spend cap that settled one attempt."""
    from tests.integration.core.test_budgets import held, send

    make_pool("p", 1)
    send("root", budget={"cost": 5})
    budgets.charge(*held("root"), cost=6)  # spends the budget: the run stops
    make_pool("c", 1, spend_cap=100.0)
    first = submit("c", 1, key="c1")
    entry = QueueEntry.objects.get(pk=first.entry_id)
    admission.settle(entry.queue_id, entry.token, "succeeded")


def test_read__budget_stops_and_spend_caps(recorder: RecordingBridge) -> None:
    _budget_and_spend_scenario()
    assert metrics.read_budget_stops() == {"cost": 1}
    by_pool = {m.pool: m for m in metrics.read()}
    assert by_pool["c"].spend_cap == 100.0
    assert 0 < by_pool["c"].spent_today < 100.0  # one slot for the attempt's few ms
    assert by_pool["p"].spend_cap is None and by_pool["p"].spent_today == 0.0


@override_settings(ROOT_URLCONF="tests.integration.surfaces.test_metrics")
def test_view__budget_stops_and_spend_caps(admin_client: Client, recorder: RecordingBridge) -> None:
    if not HAVE_CLIENT:
        if IN_CI:
            pytest.fail("prometheus_client is not installed (the 'metrics' extra)")
        pytest.skip("prometheus_client is not installed (the 'metrics' extra)")
    _budget_and_spend_scenario()
    text = admin_client.get("/metrics/").content.decode()
    assert 'pools_budget_stops_total{budget="cost"} 1.0' in text
    assert 'pools_spend_cap_slot_seconds{pool="c"} 100.0' in text
    assert 'pools_spent_today_slot_seconds{pool="c"}' in text
    assert 'pools_spend_cap_slot_seconds{pool="p"}' not in text  # no cap, no series


from django.urls import include, path  # noqa: E402  # the URLconf of the view test

urlpatterns = [path("metrics/", include("pools.metrics"))]


def test_read_waits__histogram_of_recent_waits(recorder: RecordingBridge) -> None:
    """Waits from joining the line to admission, for lines joined within the window."""
    from datetime import timedelta

    from pools.models import Demand

    make_pool("h", 4)
    waits = {"a": 0.02, "b": 2.0, "c": 100.0, "old": 1.0}
    for key in waits:
        submit("h", 1, key=key)  # all admitted at once
    now = timezone.now()
    for key, wait in waits.items():
        entry = QueueEntry.objects.get(key=key)
        admitted = now - timedelta(minutes=30) if key == "old" else now - timedelta(seconds=1)
        QueueEntry.objects.filter(pk=entry.pk).update(admitted_at=admitted)
        Demand.objects.filter(entry=entry).update(enqueued_at=admitted - timedelta(seconds=wait))
    submit("h", 1, key="waiting")  # joined the line, not admitted: not counted
    QueueEntry.objects.filter(key="waiting").update(admitted_at=None)
    hist = metrics.read_waits(now)["h"]
    counts = dict(hist.buckets)
    assert counts[0.01] == 0
    assert counts[0.05] == 1  # a
    assert counts[1.0] == 1
    assert counts[5.0] == 2  # a, b
    assert counts[60.0] == 2
    assert counts[300.0] == 3  # a, b, c ("old" joined before the window)
    assert counts[float("inf")] == 3
    assert abs(hist.total_seconds - 102.02) < 0.01
    (h,) = [p for p in metrics.read() if p.pool == "h"]
    assert h.waits == hist


def test_read__a_rate_only_pool_has_unlimited_capacity(recorder: RecordingBridge) -> None:
    from pools.core import rates

    make_pool("r", rates.UNLIMITED_SLOTS, rate="20/s")
    by_pool = {m.pool: m for m in metrics.read()}
    assert by_pool["r"].capacity == float("inf")


def _backoff_scenario() -> None:
    """Pool ``b`` backs off for a minute; pool ``n`` never did."""
    from pools.core import backoffs

    make_pool("b", 1)
    make_pool("n", 1)
    entry = QueueEntry.objects.get(pk=submit("b", key="b1").entry_id)
    assert backoffs.back_off(entry.queue_id, entry.token, 60, limit=5).requeued


def test_read__backoffs_and_the_seconds_left(recorder: RecordingBridge) -> None:
    _backoff_scenario()
    by_pool = {m.pool: m for m in metrics.read()}
    assert by_pool["b"].backoffs == 1 and by_pool["b"].paused
    assert 0 < by_pool["b"].backoff_seconds <= 60
    assert (by_pool["n"].backoffs, by_pool["n"].backoff_seconds) == (0, 0.0)


@override_settings(ROOT_URLCONF="tests.integration.surfaces.test_metrics")
def test_view__backoffs(admin_client: Client, recorder: RecordingBridge) -> None:
    if not HAVE_CLIENT:
        if IN_CI:
            pytest.fail("prometheus_client is not installed (the 'metrics' extra)")
        pytest.skip("prometheus_client is not installed (the 'metrics' extra)")
    _backoff_scenario()
    text = admin_client.get("/metrics/").content.decode()
    assert 'pools_backoffs_total{pool="b"} 1.0' in text
    assert 'pools_backoffs_total{pool="n"} 0.0' in text
    assert 'pools_backoff_remaining_seconds{pool="n"} 0.0' in text
    assert 'pools_backoff_remaining_seconds{pool="b"} 5' in text  # 59.9… s left
