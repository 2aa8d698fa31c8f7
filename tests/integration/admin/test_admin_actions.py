"""Admin pages and actions: pools (pause/resume), entries (filters, why, cancel), Run now."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from django.test.client import (
        _MonkeyPatchedWSGIResponse,  # the test client's response type (stubs)
    )

import re

import pytest
from django.contrib import admin
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from pools.models import Pool, PoolEvent, QueueEntry
from pools.states import EntryState, EventKind, Origin
from tests.support.admin import ADMIN_APPS
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit
from tests.testapp.tasks import add, free_span

pytestmark = pytest.mark.django_db(transaction=True, available_apps=ADMIN_APPS)


def _action(
    client: Client, model: str, action: str, pks: list[int], **extra: str
) -> _MonkeyPatchedWSGIResponse:
    return client.post(
        reverse(f"admin:pools_{model}_changelist"),
        {"action": action, "_selected_action": [str(pk) for pk in pks], **extra},
        follow=True,
    )


@pytest.fixture
def line(recorder: RecordingBridge) -> RecordingBridge:
    make_pool("wh", 1)
    submit("wh", key="holder")
    submit("wh", key="w1", priority=3)
    submit("wh", key="w2")
    return recorder


def test_pool_admin__list_shows_capacity_held_waiting_paused(
    admin_client: Client, line: RecordingBridge
) -> None:
    html = admin_client.get(reverse("admin:pools_pool_changelist")).content.decode()
    row = html[html.index(">wh<") :]
    row = row[: row.index("</tr>")]
    cells = [c.split(">", 1)[1].split("<", 1)[0] for c in row.split('<td class="field-')[1:]]
    assert cells[:5] == ["1", "1", "", "1", "2"]  # slots, capacity, draining (icon), held, waiting
    assert 'alt="False"' in row  # not paused
    assert "/admin/pools/pool/occupancy/wh/" in row


def test_pool_admin__pause_and_resume_go_through_the_service(
    admin_client: Client, line: RecordingBridge
) -> None:
    pool = Pool.objects.get(name="wh")
    response = _action(admin_client, "pool", "pause_pools", [pool.pk])
    assert "Paused wh." in response.content.decode()
    assert Pool.objects.get(name="wh").paused
    assert PoolEvent.objects.filter(
        kind=EventKind.CAPACITY_CHANGED, pool="wh", detail__paused=True
    ).exists()
    again = _action(admin_client, "pool", "pause_pools", [pool.pk])
    assert "already paused" in again.content.decode()
    # While paused, a freed slot admits nothing; resuming admits the head at once.
    holder = next(a for a in line.admissions if a.key == "holder")
    from pools.core import admission

    assert admission.settle(holder.entry_id, holder.token, "succeeded")
    assert QueueEntry.objects.get(key="w1").state == EntryState.WAITING
    response = _action(admin_client, "pool", "resume_pools", [pool.pk])
    assert "Resumed wh." in response.content.decode()
    assert QueueEntry.objects.get(key="w1").state == EntryState.ADMITTED


def test_pool_admin__changing_slots_drains_through_the_service(
    admin_client: Client, line: RecordingBridge
) -> None:
    pool = Pool.objects.get(name="wh")
    url = reverse("admin:pools_pool_change", args=[pool.pk])
    form = {
        "slots": "3",
        "max_queued": "",
        "description": "",
        "overflow": "drop_oldest",
        "paused_policy": "queue",
        "strategy": "priority",
        "aging_seconds": "",
    }
    response = admin_client.post(url, form, follow=True)
    assert response.status_code == 200
    pool = Pool.objects.get(name="wh")
    # Two entries wait: the old capacity stays in effect while they drain.
    assert (pool.slots, pool.pending_slots, pool.overflow) == (1, 3, "drop_oldest")
    assert PoolEvent.objects.filter(
        kind=EventKind.CAPACITY_CHANGED, pool="wh", detail__draining=True
    ).exists()
    # The change form shows the configured capacity; saving it again changes nothing.
    html = admin_client.get(url).content.decode()
    assert 'name="slots" value="3"' in html
    admin_client.post(url, form, follow=True)
    assert Pool.objects.get(name="wh").pending_slots == 3
    row = admin_client.get(reverse("admin:pools_pool_changelist")).content.decode()
    assert 'class="field-draining"><img' in row and 'alt="True"' in row


def test_pool_admin__add_goes_through_the_service(admin_client: Client) -> None:
    response = admin_client.post(
        reverse("admin:pools_pool_add"),
        {
            "name": "fresh",
            "slots": "2",
            "max_queued": "",
            "description": "",
            "overflow": "reject",
            "paused_policy": "reject",
            "strategy": "priority",
        },
        follow=True,
    )
    assert response.status_code == 200
    pool = Pool.objects.get(name="fresh")
    assert (pool.slots, pool.paused_policy, pool.defined_in_settings) == (2, "reject", False)


def test_entry_admin__filters_by_pool_state_task_origin_and_searches(
    admin_client: Client, line: RecordingBridge
) -> None:
    make_pool("other", 1)
    submit("other", key="elsewhere", origin=Origin.MANUAL)
    url = reverse("admin:pools_queueentry_changelist")

    by_id = {str(i): k for k, i in QueueEntry.objects.values_list("key", "queue_id")}

    def keys(query: str) -> set[str]:
        html = admin_client.get(url + query).content.decode()
        return {
            by_id[i]
            for i in re.findall(r'field-queue_id"><a href="/admin/pools/queueentry/(\d+)/', html)
        }

    html = admin_client.get(url).content.decode()
    for title in ("By pool", "By state", "By task", "By origin"):
        assert title in html
    assert keys("?pool=other") == {"elsewhere"}
    assert keys("?pool=wh&state__exact=waiting") == {"w1", "w2"}
    assert keys("?origin__exact=manual") == {"elsewhere"}
    assert keys("?q=w2") == {"w2"}
    assert keys("?task_name=tests.fake") == {"holder", "w1", "w2", "elsewhere"}


def test_entry_admin__detail_is_read_only_and_says_why_it_waits(
    admin_client: Client, line: RecordingBridge
) -> None:
    entry = QueueEntry.objects.get(key="w2")
    html = admin_client.get(
        reverse("admin:pools_queueentry_change", args=[entry.queue_id])
    ).content.decode()
    assert "Where it stands" in html
    assert 'data-pool="wh" data-blocked-by="pool_full"' in html
    assert "Position 2." in html
    assert 'name="_save"' not in html and "deletelink" not in html
    assert f"/admin/pools/queueentry/{entry.queue_id}/panel/" in html
    # Read-only: a POST of the form is refused (rows change only through the services).
    assert (
        admin_client.post(
            reverse("admin:pools_queueentry_change", args=[entry.queue_id]), {}
        ).status_code
        == 405
    )
    assert QueueEntry.objects.get(key="w2").state == EntryState.WAITING


def test_entry_admin__cancel_actions(admin_client: Client, line: RecordingBridge) -> None:
    ids = dict(QueueEntry.objects.values_list("key", "queue_id"))
    response = _action(admin_client, "queueentry", "cancel_entries", [ids["w2"], ids["holder"]])
    html = response.content.decode()
    assert f"Cancelled: #{ids['w2']}." in html
    assert "1 selected entry was not waiting (use cancel-and-terminate)." in html
    assert QueueEntry.objects.get(key="w2").state == EntryState.CANCELLED
    assert QueueEntry.objects.get(key="holder").state == EntryState.ADMITTED
    response = _action(admin_client, "queueentry", "cancel_and_terminate", [ids["holder"]])
    assert f"Cancelled or stopping: #{ids['holder']}." in response.content.decode()
    assert line.terminated == ["holder"]


def test_entry_admin__cancel_needs_change_permission(line: RecordingBridge) -> None:
    user = User.objects.create_user("viewer", password="pw", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_queueentry"))
    client = Client()
    client.force_login(user)
    html = client.get(reverse("admin:pools_queueentry_changelist")).content.decode()
    assert "cancel_entries" not in html
    entry = QueueEntry.objects.get(key="w1")
    response = _action(client, "queueentry", "cancel_entries", [entry.queue_id])
    assert response.status_code == 200
    assert QueueEntry.objects.get(key="w1").state == EntryState.WAITING


def test_entry_admin__no_add_no_delete(admin_client: Client, line: RecordingBridge) -> None:
    assert admin_client.get(reverse("admin:pools_queueentry_add")).status_code == 403
    html = admin_client.get(reverse("admin:pools_queueentry_changelist")).content.decode()
    assert "delete_selected" not in html


# --------------------------------------------------------------------------- Run now


@pytest.fixture
def jobs(recorder: RecordingBridge) -> dict[str, PeriodicTask]:
    make_pool("warehouse", 1, max_queued=1)
    every = IntervalSchedule.objects.create(every=1, period=IntervalSchedule.HOURS)
    return {
        name: PeriodicTask.objects.create(
            name=name, task=task, args=args, interval=every, enabled=False
        )
        for name, task, args in [
            ("first add", add.name, "[1, 2]"),
            ("second add", add.name, "[3, 4]"),
            ("third add", add.name, "[5, 6]"),
            ("plain", free_span.name, "[1]"),
        ]
    }


def _run_now(client: Client, *jobs: PeriodicTask) -> str:
    response = client.post(
        reverse("admin:django_celery_beat_periodictask_changelist"),
        {"action": "run_now", "_selected_action": [str(j.pk) for j in jobs]},
        follow=True,
    )
    assert response.status_code == 200
    return response.content.decode()


def test_run_now__is_on_the_periodic_task_admin() -> None:
    from django_celery_beat.admin import PeriodicTaskAdmin

    registered = admin.site._registry[PeriodicTask]
    assert getattr(registered, "pools_run_now", False)
    assert isinstance(registered, PeriodicTaskAdmin)  # beat's own admin, one action more


def test_run_now__queued_position_and_refusal(
    admin_client: Client, jobs: dict[str, PeriodicTask]
) -> None:
    html = _run_now(admin_client, jobs["first add"])
    first = QueueEntry.objects.get(origin=Origin.MANUAL, args=[1, 2])
    assert (
        f"First add: queued in warehouse as entry #{first.queue_id} (admitted at once), "
        f"task id {first.key}." in html
    )
    html = _run_now(admin_client, jobs["second add"])
    second = QueueEntry.objects.get(origin=Origin.MANUAL, args=[3, 4])
    assert f"entry #{second.queue_id} (waiting, position 1 in warehouse)" in html
    html = _run_now(admin_client, jobs["third add"])
    assert "Third add: not started. Pool &#x27;warehouse&#x27; is full" in html
    assert not QueueEntry.objects.filter(args=[5, 6]).exists()


def test_run_now__unpooled_job_is_sent_as_is(
    admin_client: Client, jobs: dict[str, PeriodicTask]
) -> None:
    html = _run_now(admin_client, jobs["plain"])
    assert "Plain: sent to Celery (not pooled), task id " in html
    assert not QueueEntry.objects.filter(origin=Origin.MANUAL).exists()


def test_run_now__needs_change_permission_on_periodic_tasks(jobs: dict[str, PeriodicTask]) -> None:
    user = User.objects.create_user("viewer", password="pw", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_periodictask"))
    client = Client()
    client.force_login(user)
    _run_now(client, jobs["first add"])
    assert not QueueEntry.objects.filter(origin=Origin.MANUAL).exists()


def test_pool_admin__strategy_and_aging_are_edited_through_the_service(
    admin_client: Client, line: RecordingBridge
) -> None:
    pool = Pool.objects.get(name="wh")
    url = reverse("admin:pools_pool_change", args=[pool.pk])
    form = {
        "slots": "1",
        "max_queued": "",
        "description": "",
        "overflow": "reject",
        "paused_policy": "queue",
        "strategy": "fifo",
        "aging_seconds": "30",
    }
    refused = admin_client.post(url, form)
    assert refused.status_code == 200  # the form again, with the error
    assert "aging_seconds applies to strategy" in refused.content.decode()
    assert Pool.objects.get(name="wh").strategy == "priority"
    form["aging_seconds"] = ""
    admin_client.post(url, form, follow=True)
    assert Pool.objects.get(name="wh").strategy == "fifo"
    # The waiting entries took their fifo places, and the change is in the log.
    assert PoolEvent.objects.filter(
        kind=EventKind.CAPACITY_CHANGED, pool="wh", detail__field="strategy", detail__to="fifo"
    ).exists()
    changelist = admin_client.get(reverse("admin:pools_pool_changelist")).content.decode()
    assert "fifo" in changelist
