"""Per-key limit values: overrides set at runtime (service, REST, admin), the template's
values callable, retirement and re-creation, sync from settings, and where they show."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from pytest_django import Settings

from pools import rates_text
from pools.core import overrides, per_key, pool_crud, settings_sync
from pools.exceptions import PoolConfigurationError
from pools.models import EventKind, Pool, PoolEvent, PoolOverride
from tests.support.admin import ADMIN_APPS, card_row
from tests.support.api import client_for, make_user, url
from tests.support.bridge import RecordingBridge
from tests.testapp.tasks import tenant_job

pytestmark = pytest.mark.django_db(transaction=True, available_apps=ADMIN_APPS)

PATTERN = "tenant:{tenant_id}"
CALLABLE = "tests.integration.core.test_per_key_overrides.limits_for"
#: What :func:`limits_for` answers, by tenant (changed by the tests).
PLANS: dict[str, Any] = {}


def limits_for(tenant_id: str) -> Any:
    """The test's values callable: the plan of ``tenant_id`` (raises for ``boom``)."""
    if tenant_id == "boom":
        raise RuntimeError("plan service down")
    return PLANS.get(tenant_id)


@pytest.fixture
def templates(settings: Settings) -> Settings:
    settings.POOLS = {
        **settings.POOLS,
        "TEMPLATES": {PATTERN: {"slots": 2, "max_queued": 100}},
        "TEMPLATE_IDLE_SECONDS": 60,
    }
    PLANS.clear()
    return settings


@pytest.fixture
def with_plans(templates: Settings) -> Settings:
    templates.POOLS = {
        **templates.POOLS,
        "TEMPLATES": {PATTERN: {"slots": 2, "max_queued": 100, "values": CALLABLE}},
    }
    return templates


def _limits(name: str) -> tuple[int, str, int | None]:
    pool = Pool.objects.get(name=name)
    return (pool.pending_slots or pool.slots, pool.rate, pool.max_queued)


def _retire(name: str) -> None:
    """Let the sweep retire the idle pool ``name`` (made long ago, never used since)."""
    Pool.objects.filter(name=name).update(created_at=timezone.now() - timedelta(hours=2))
    assert name in per_key.retire_idle(timezone.now())
    assert not Pool.objects.filter(name=name).exists()


# --------------------------------------------------------------------------- service


def test_override__survives_retirement_and_re_creation(templates: Settings) -> None:
    per_key.ensure_pool("tenant:big", PATTERN)
    per_key.ensure_pool("tenant:small", PATTERN)
    overrides.set_overrides("tenant:big", {"slots": 8, "rate": "5/s"}, actor="ops")
    assert _limits("tenant:big") == (8, "5/s", 100)
    _retire("tenant:big")
    _retire("tenant:small")
    assert PoolOverride.objects.get(pool="tenant:big").values == {"slots": 8, "rate": "5/s"}
    per_key.ensure_pool("tenant:big", PATTERN)
    per_key.ensure_pool("tenant:small", PATTERN)
    assert _limits("tenant:big") == (8, "5/s", 100)
    assert _limits("tenant:small") == (2, "", 100)
    created = PoolEvent.objects.filter(kind=EventKind.POOL_CREATED, pool="tenant:big").last()
    assert created is not None and created.detail["override"] == {"slots": 8, "rate": "5/s"}


def test_override__set_before_first_use_applies_at_creation(templates: Settings) -> None:
    overrides.set_overrides("tenant:new", {"max_queued": None}, actor="ops")
    assert not Pool.objects.filter(name="tenant:new").exists()
    per_key.ensure_pool("tenant:new", PATTERN)
    assert _limits("tenant:new") == (2, "", None)


def test_override__saved_while_a_first_use_creates_the_pool_is_applied(
    templates: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first use read the overrides (none), then an override is saved, then the pool is
    created: the creation applies the override it now finds."""
    real = overrides.limits_for

    def read_then_override(name: str, pattern: str, **kwargs: Any) -> overrides.Limits:
        limits = real(name, pattern, **kwargs)
        if not Pool.objects.filter(name=name).exists():
            pool_crud.save_override(name, pattern, {"slots": 6}, actor="ops")
        return limits

    monkeypatch.setattr(overrides, "limits_for", read_then_override)
    per_key.ensure_pool("tenant:race", PATTERN)
    assert _limits("tenant:race")[0] == 6


@pytest.mark.server_db
def test_concurrent_first_overrides__of_one_name_merge(templates: Settings) -> None:
    """Two connections override two limits of a key that has no row yet, at once: one row
    with both, no error (PostgreSQL and MariaDB; SQLite serializes writers)."""
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def override(values: dict[str, Any]) -> None:
        try:
            barrier.wait()
            overrides.set_overrides("tenant:twice", values, actor="ops")
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [
        threading.Thread(target=override, args=(v,)) for v in ({"slots": 5}, {"max_queued": 9})
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert overrides.current("tenant:twice") == {"slots": 5, "max_queued": 9}


def test_sync__never_overwrites_an_override_and_applies_the_template_elsewhere(
    templates: Settings,
) -> None:
    per_key.ensure_pool("tenant:big", PATTERN)
    per_key.ensure_pool("tenant:small", PATTERN)
    overrides.set_overrides("tenant:big", {"slots": 8})
    templates.POOLS = {
        **templates.POOLS,
        "TEMPLATES": {PATTERN: {"slots": 4, "max_queued": 50, "rate": "1/s"}},
    }
    report = settings_sync.sync()
    assert report.per_key == ["tenant:big", "tenant:small"]
    # big keeps its slots (override) and takes the template's other new values.
    assert _limits("tenant:big") == (8, "1/s", 50)
    assert _limits("tenant:small") == (4, "1/s", 50)
    # A second sync has nothing to do.
    assert settings_sync.sync().per_key == []
    # migrate runs the same sync: still no overwrite.
    call_command("migrate", verbosity=0)
    assert _limits("tenant:big") == (8, "1/s", 50)


def test_removing_an_override__returns_to_the_template(templates: Settings) -> None:
    per_key.ensure_pool("tenant:big", PATTERN)
    overrides.set_overrides("tenant:big", {"slots": 8, "max_queued": 5}, actor="ops")
    assert overrides.clear_overrides("tenant:big", ["slots"], actor="ops") == {"max_queued": 5}
    assert _limits("tenant:big") == (2, "", 5)
    assert overrides.clear_overrides("tenant:big", actor="ops") == {}
    assert _limits("tenant:big") == (2, "", 100)
    assert not PoolOverride.objects.filter(pool="tenant:big").exists()
    events = PoolEvent.objects.filter(pool="tenant:big", kind=EventKind.CAPACITY_CHANGED)
    who = [(e.actor, e.detail.get("override"), e.detail.get("override_removed")) for e in events]
    assert ("ops", {"slots": 8, "max_queued": 5}, None) in who
    assert ("ops", None, ["slots"]) in who
    assert ("ops", None, ["max_queued"]) in who


def test_update_pool__on_a_per_key_pool_is_an_override_on_a_plain_pool_not(
    templates: Settings,
) -> None:
    per_key.ensure_pool("tenant:edit", PATTERN)
    pool_crud.create_pool(name="plain", slots=1)
    pool_crud.update_pool("tenant:edit", slots=3, description="vip", actor="ann")
    pool_crud.update_pool("plain", slots=3, actor="ann")
    assert overrides.current("tenant:edit") == {"slots": 3}  # the description is no limit
    assert not PoolOverride.objects.filter(pool="plain").exists()
    with pytest.raises(PoolConfigurationError, match="not a per-key pool"):
        overrides.set_overrides("plain", {"slots": 2})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"slots": 0}, "slots must be a positive integer, got 0."),
        ({"rate": "1/y"}, "'1/y' is not a rate"),
        ({"strategy": "fifo"}, "Unknown limit(s) ['strategy']"),
        ({}, "Give at least one of"),
    ],
)
def test_bad_override__is_refused_and_changes_nothing(
    templates: Settings, values: dict[str, Any], message: str
) -> None:
    per_key.ensure_pool("tenant:bad", PATTERN)
    with pytest.raises(PoolConfigurationError) as caught:
        overrides.set_overrides("tenant:bad", values)
    assert message in str(caught.value)
    assert _limits("tenant:bad") == (2, "", 100)
    assert not PoolOverride.objects.exists()


# --------------------------------------------------------------------------- the callable


def test_values_callable__maps_the_key_to_its_plan(with_plans: Settings) -> None:
    PLANS["acme"] = {"slots": 8, "rate": ["20/s", "1000/d"]}
    per_key.ensure_pool("tenant:acme", PATTERN)
    per_key.ensure_pool("tenant:globex", PATTERN)
    assert _limits("tenant:acme") == (8, "20/s,1000/d", 100)
    assert _limits("tenant:globex") == (2, "", 100)
    # An override wins over the plan; removing it returns to the plan, not the template.
    overrides.set_overrides("tenant:acme", {"slots": 16})
    assert _limits("tenant:acme")[0] == 16
    overrides.clear_overrides("tenant:acme")
    assert _limits("tenant:acme")[0] == 8
    # A plan change applies on sync (no override).
    PLANS["acme"] = {"slots": 12}
    settings_sync.sync()
    assert _limits("tenant:acme") == (12, "", 100)


def test_values_callable__a_rate_alone_plan_is_unlimited_slots(with_plans: Settings) -> None:
    PLANS["r"] = {"slots": rates_text.UNLIMITED_SLOTS, "rate": "3/s"}
    per_key.ensure_pool("tenant:r", PATTERN)
    assert _limits("tenant:r") == (rates_text.UNLIMITED_SLOTS, "3/s", 100)


@pytest.mark.parametrize(
    ("tenant", "plan", "message"),
    [
        ("zero", {"slots": 0}, "['slots'] must be a positive integer, got 0."),
        ("list", [8], "must return a dict of ['slots', 'rate', 'max_queued']"),
        ("extra", {"paused": True}, "unknown limit(s) ['paused']"),
        ("boom", None, "raised RuntimeError: plan service down"),
    ],
)
def test_values_callable__a_bad_answer_is_a_clear_error_and_the_template_applies(
    with_plans: Settings,
    caplog: pytest.LogCaptureFixture,
    tenant: str,
    plan: Any,
    message: str,
) -> None:
    PLANS[tenant] = plan
    with caplog.at_level(logging.ERROR, logger="pools.overrides"):
        pool = per_key.ensure_pool(f"tenant:{tenant}", PATTERN)
    assert _limits(pool.name) == (2, "", 100)
    logged = [r.getMessage() for r in caplog.records if r.name == "pools.overrides"]
    assert len(logged) == 1
    assert CALLABLE in logged[0] and message in logged[0]
    assert "The template's values apply to" in logged[0]
    created = PoolEvent.objects.get(kind=EventKind.POOL_CREATED, pool=pool.name)
    assert created.detail["values_error"] == logged[0]


def test_values_callable__that_cannot_be_imported_is_a_check_error(templates: Settings) -> None:
    from pools.checks import check_settings

    templates.POOLS = {
        **templates.POOLS,
        "TEMPLATES": {PATTERN: {"slots": 2, "values": "tests.nowhere.limits_for"}},
    }
    errors = [e for e in check_settings(None) if e.id == "pools.E030"]
    assert len(errors) == 1 and "'tests.nowhere.limits_for' cannot be imported" in errors[0].msg
    # A submit still works: the template's values apply.
    per_key.ensure_pool("tenant:x", PATTERN)
    assert _limits("tenant:x") == (2, "", None)


# --------------------------------------------------------------------------- REST


def test_rest__read_set_and_remove_overrides(
    templates: Settings, recorder: RecordingBridge
) -> None:
    tenant_job.delay("acme")
    client = client_for("pools.view_pool", "pools.change_pool")
    got = client.get(url("pools/tenant:acme/overrides")).json()
    assert got["overrides"] == {} and got["exists"] is True
    assert got["limits"]["slots"] == {
        "value": 2,
        "source": "template",
        "template": 2,
        "without_override": 2,
    }
    answer = client.patch(
        url("pools/tenant:acme/overrides"), {"slots": 8, "rate": "10/s"}, format="json"
    )
    assert answer.status_code == 200, answer.content
    assert answer.json()["overrides"] == {"slots": 8, "rate": "10/s"}
    assert answer.json()["limits"]["slots"]["source"] == "override"
    assert _limits("tenant:acme") == (8, "10/s", 100)
    pool = client.get(url("pools/tenant:acme/")).json()
    assert pool["template"] == PATTERN
    assert pool["overrides"] == {
        "slots": {"value": 8, "template": 2},
        "rate": {"value": "10/s", "template": ""},
    }
    event = PoolEvent.objects.filter(pool="tenant:acme", detail__has_key="override").get()
    assert event.actor.startswith("user") and event.detail["override"] == {
        "slots": 8,
        "rate": "10/s",
    }
    answer = client.delete(url("pools/tenant:acme/overrides?fields=rate"))
    assert answer.status_code == 200 and answer.json()["overrides"] == {"slots": 8}
    assert _limits("tenant:acme") == (8, "", 100)
    # A PATCH of the pool itself keeps its limits as overrides too.
    client.patch(url("pools/tenant:acme/"), {"max_queued": 7}, format="json")
    assert overrides.current("tenant:acme") == {"slots": 8, "max_queued": 7}


def test_rest__override_for_a_key_not_used_yet(templates: Settings) -> None:
    client = client_for("pools.view_pool", "pools.change_pool")
    answer = client.patch(url("pools/tenant:later/overrides"), {"slots": 5}, format="json")
    assert answer.status_code == 200 and answer.json()["exists"] is False
    per_key.ensure_pool("tenant:later", PATTERN)
    assert _limits("tenant:later")[0] == 5


def test_rest__bad_input_permissions_and_unknown_names(templates: Settings) -> None:
    per_key.ensure_pool("tenant:acme", PATTERN)
    pool_crud.create_pool(name="plain", slots=1)
    viewer = client_for("pools.view_pool")
    assert viewer.get(url("pools/tenant:acme/overrides")).status_code == 200
    refused = viewer.patch(url("pools/tenant:acme/overrides"), {"slots": 8}, format="json")
    assert refused.status_code == 403
    assert viewer.delete(url("pools/tenant:acme/overrides")).status_code == 403
    client = client_for("pools.view_pool", "pools.change_pool")
    bad = client.patch(url("pools/tenant:acme/overrides"), {"slots": 0}, format="json")
    assert bad.status_code == 400
    assert bad.json() == {"slots": ["slots must be a positive integer, got 0."]}
    other = client.patch(url("pools/tenant:acme/overrides"), {"paused": True}, format="json")
    assert other.status_code == 400 and "Unknown field(s) ['paused']" in str(other.json())
    empty = client.patch(url("pools/tenant:acme/overrides"), {}, format="json")
    assert empty.status_code == 400
    bad_field = client.delete(url("pools/tenant:acme/overrides?fields=strategy"))
    assert bad_field.status_code == 400 and "fields" in bad_field.json()
    for name in ("plain", "nothing-like-it"):
        assert client.get(url(f"pools/{name}/overrides")).status_code == 404
        patch = client.patch(url(f"pools/{name}/overrides"), {"slots": 2}, format="json")
        assert patch.status_code == 404
    assert _limits("tenant:acme") == (2, "", 100)
    assert not PoolOverride.objects.exists()


# --------------------------------------------------------------------------- admin, list


def test_admin__a_change_is_an_override_shown_on_the_card_page_and_list(
    templates: Settings, admin_client: Client
) -> None:
    pool = per_key.ensure_pool("tenant:acme", PATTERN)
    change = reverse("admin:pools_pool_change", args=[pool.pk])
    form = {
        "slots": "8",
        "max_queued": "100",
        "description": "",
        "overflow": "reject",
        "paused_policy": "queue",
        "strategy": "priority",
        "aging_seconds": "",
        "spend_cap": "",
        "rate": "",
    }
    answer = admin_client.post(change, form)
    assert answer.status_code == 302, answer.content.decode()[:2000]
    assert overrides.current("tenant:acme") == {"slots": 8}
    assert PoolEvent.objects.get(detail__has_key="override").actor == "admin"
    label = "slots 8 (override; template 2)"
    assert label in card_row(admin_client.get("/admin/").content.decode(), "tenant:acme")
    assert label in admin_client.get(change).content.decode()
    out = StringIO()
    call_command("pools", "list", stdout=out)
    line = next(x for x in out.getvalue().splitlines() if x.startswith("tenant:acme"))
    assert f"({label})" in line
    # The admin action removes the overrides: back to the template.
    changelist = reverse("admin:pools_pool_changelist")
    admin_client.post(
        changelist, {"action": "remove_overrides", "_selected_action": [str(pool.pk)]}
    )
    assert overrides.current("tenant:acme") == {}
    assert _limits("tenant:acme")[0] == 2
    assert label not in card_row(admin_client.get("/admin/").content.decode(), "tenant:acme")


def test_admin__override_list_shows_retired_keys_and_removes_through_the_service(
    templates: Settings, admin_client: Client
) -> None:
    overrides.set_overrides("tenant:later", {"slots": 5}, actor="ops")  # no pool yet
    changelist = reverse("admin:pools_pooloverride_changelist")
    page = admin_client.get(changelist).content.decode()
    assert "tenant:later" in page and "slots 5 (override; template 2)" in page
    # A viewer of pools sees the list but cannot remove.
    viewer = Client()
    viewer.force_login(make_user("pools.view_pool", staff=True))
    assert viewer.get(changelist).status_code == 200
    row = PoolOverride.objects.get(pool="tenant:later")
    viewer.post(changelist, {"action": "remove_selected", "_selected_action": [str(row.pk)]})
    assert overrides.current("tenant:later") == {"slots": 5}
    admin_client.post(changelist, {"action": "remove_selected", "_selected_action": [str(row.pk)]})
    assert not PoolOverride.objects.exists()
    removed = PoolEvent.objects.get(detail__has_key="override_removed")
    assert (removed.pool, removed.actor, removed.detail["override_removed"]) == (
        "tenant:later",
        "admin",
        ["slots"],
    )


def test_override_of_a_pattern_gone_from_settings__can_still_be_removed(
    templates: Settings,
) -> None:
    overrides.set_overrides("tenant:old", {"slots": 5})
    templates.POOLS = {**templates.POOLS, "TEMPLATES": {}}
    assert overrides.clear_overrides("tenant:old") == {}
    assert not PoolOverride.objects.exists()
    with pytest.raises(PoolConfigurationError, match="not a per-key pool"):
        overrides.clear_overrides("tenant:old")
