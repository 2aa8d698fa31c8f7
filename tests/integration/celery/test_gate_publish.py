"""Publish side of the gate, in-process (memory broker): entries instead of messages."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from celery import signals
from django.db import transaction
from django.utils import timezone
from kombu.exceptions import EncodeError
from pytest_django import Settings

from pools.celery import messages
from pools.exceptions import PoolConfigurationError, UnknownPool
from pools.models import QueueEntry
from pools.states import EntryState
from tests.conftest import POOL_APPS
from tests.integration.celery.conftest import Broker
from tests.support.factories import make_pool
from tests.testapp.tasks import add, record

pytestmark = pytest.mark.django_db(transaction=True, available_apps=POOL_APPS)


@pytest.fixture
def publish_signals() -> Iterator[list[dict[str, Any]]]:
    """Headers seen by ``before_task_publish`` (runs in the caller, as in plain Celery)."""
    seen: list[dict[str, Any]] = []

    def grab(sender: Any = None, headers: dict[str, Any] | None = None, **kwargs: Any) -> None:
        seen.append(dict(headers or {}))

    signals.before_task_publish.connect(grab, weak=False)
    yield seen
    signals.before_task_publish.disconnect(grab)


def test_delay__creates_entry_with_task_id_and_publishes_with_claim(
    broker: Broker, publish_signals: list[dict[str, Any]]
) -> None:
    make_pool("warehouse", 1)
    first = add.delay(1, 2)
    second = add.delay(3, 4)
    e1 = QueueEntry.objects.get(key=first.id)
    e2 = QueueEntry.objects.get(key=second.id)
    assert (e1.state, e2.state) == (EntryState.ADMITTED, EntryState.WAITING)
    assert e2.args == [3, 4] and e2.task_name == add.name
    published = broker.drain()
    assert [h.get("id") for h in published] == [first.id], "the waiting call is not published"
    assert published[0]["pools_claim"] == f"{e1.queue_id}:{e1.token}"
    # The publish signal ran once per call, in the caller, as in plain Celery.
    assert [h["id"] for h in publish_signals] == [first.id, second.id]


def test_apply_async__pool_options_and_countdown(broker: Broker) -> None:
    make_pool("warehouse", 1)
    before = timezone.now()
    result = record.apply_async(  # type: ignore[call-arg]  # celery-types: no **options
        (1,), countdown=60, pool_options={"priority": 9, "queue_timeout": 30}
    )
    entry = QueueEntry.objects.get(key=result.id)
    assert entry.priority == 9
    assert entry.not_before is not None and entry.deadline is not None
    assert entry.not_before >= before + timedelta(seconds=59)
    assert entry.deadline >= entry.not_before + timedelta(seconds=29)
    assert entry.state == EntryState.WAITING, "an entry with a future ETA is not admitted yet"
    # The held message carries the ETA Celery computed, as the body will see it.
    held = messages.held_in(entry.options)
    assert held is not None and held.header_time("eta") == entry.not_before
    # The task itself is not published; a timed admission pass is, for when its ETA arrives.
    published = broker.drain()
    assert [h["task"] for h in published] == ["pools.admit"]
    assert published[0]["eta"] is not None


def test_pool_options__refused_for_unpooled_task() -> None:
    from tests.celery_app import app

    with pytest.raises(PoolConfigurationError, match="not pooled"):
        app.send_task("tests.not_pooled", pool_options={"priority": 1})


def test_unknown_pool__raises_at_call(settings: Settings) -> None:
    # A task pooled by name only (POOLS["TASKS"]) on a pool nobody defined.
    settings.POOLS = {**settings.POOLS, "TASKS": {"tests.by_name": {"pools": "ghost"}}}
    from tests.celery_app import app

    with pytest.raises(UnknownPool, match="'ghost' does not exist"):
        app.send_task("tests.by_name", (1,))
    assert QueueEntry.objects.count() == 0


def test_tasks_setting__pools_a_task_known_only_by_name(settings: Settings) -> None:
    settings.POOLS = {**settings.POOLS, "TASKS": {"tests.by_name": {"pools": {"warehouse": 1}}}}
    from tests.celery_app import app

    result = app.send_task("tests.by_name", (1,))
    assert QueueEntry.objects.get(key=result.id).demand == {"warehouse": 1}


def test_arguments__what_the_serializer_refuses_is_refused_in_the_caller() -> None:
    make_pool("warehouse", 1)
    with pytest.raises(EncodeError, match="not JSON serializable"):
        add.delay(object(), 1)  # type: ignore[arg-type]  # on purpose: not serializable
    assert QueueEntry.objects.count() == 0


def test_arguments__bytes_are_held_as_celery_sends_them(broker: Broker) -> None:
    make_pool("warehouse", 1)
    add.delay(b"\x00raw", 1)  # type: ignore[arg-type]  # on purpose: bytes
    (entry,) = QueueEntry.objects.all()
    held = messages.held_in(entry.options)
    assert held is not None
    args, kwargs, _ = held.decode(accept=["json"])
    assert args == [b"\x00raw", 1] and kwargs == {}
    assert [h["id"] for h in broker.drain()] == [entry.key]


@pytest.mark.parametrize(
    ("serializer", "compression", "value"),
    [
        ("json", None, {"when": "2026-12-03", "raw": b"\x01"}),
        ("pickle", None, {1, 2, 3}),  # a set: pickle carries what JSON cannot
        ("yaml", None, {"nested": [1, {"a": None}]}),
        ("json", "zlib", "x" * 500),
    ],
)
def test_arguments__held_with_the_serializer_and_compression_celery_uses(
    broker: Broker, serializer: str, compression: str | None, value: object
) -> None:
    make_pool("warehouse", 1)
    options: dict[str, Any] = {"serializer": serializer, "compression": compression}
    result = record.apply_async((value,), **options)
    entry = QueueEntry.objects.get(key=result.id)
    held = messages.held_in(entry.options)
    assert held is not None
    assert (
        held.content_type
        == {
            "json": "application/json",
            "pickle": "application/x-python-serialize",
            "yaml": "application/x-yaml",
        }[serializer]
    )
    assert held.headers.get("compression") == (
        "application/x-gzip" if compression == "zlib" else None
    )
    args, _, _ = held.decode(accept=[serializer])
    assert args[0] == value
    (published,) = broker.drain()
    assert published["id"] == result.id


def test_delay_on_commit__enqueues_only_after_commit() -> None:
    make_pool("warehouse", 1)
    with transaction.atomic():
        add.delay_on_commit(5, 6)  # type: ignore[attr-defined]  # Celery 5.4+, not in celery-types
        assert QueueEntry.objects.count() == 0
    assert QueueEntry.objects.get().args == [5, 6]


def test_rolled_back_enqueue__leaves_nothing(broker: Broker) -> None:
    make_pool("warehouse", 1)
    with pytest.raises(RuntimeError), transaction.atomic():
        add.delay(1, 1)
        raise RuntimeError("boom")
    assert QueueEntry.objects.count() == 0
    assert broker.drain() == [], "no message for a claim that was rolled back"


def test_fairness_key__from_the_decorator_callable_or_pool_options() -> None:
    from tests.testapp.tasks import per_tenant

    make_pool("tenants", 1, strategy="fair")
    by_args = per_tenant.delay(7, n=1)
    by_kwargs = per_tenant.apply_async(kwargs={"tenant_id": "acme"})
    by_option = per_tenant.apply_async(  # type: ignore[call-arg]  # celery-types: no **options
        (7,), pool_options={"fairness_key": "tenant-9"}
    )
    results = (by_args, by_kwargs, by_option)
    keys = {r.id: QueueEntry.objects.get(key=r.id).fairness_key for r in results}
    assert keys == {by_args.id: "7", by_kwargs.id: "acme", by_option.id: "tenant-9"}
    # None from the callable: no key (the keyless group).
    assert QueueEntry.objects.get(key=per_tenant.delay(None).id).fairness_key == ""  # type: ignore[arg-type]
    # A callable whose result cannot be a key refuses the call, and nothing is stored.
    with pytest.raises(PoolConfigurationError, match="fairness_key callable"):
        per_tenant.delay("")  # type: ignore[arg-type]
    assert QueueEntry.objects.count() == 4
    with pytest.raises(PoolConfigurationError, match="fairness_key"):
        per_tenant.apply_async((1,), pool_options={"fairness_key": ["not", "a", "str"]})  # type: ignore[call-arg]


def test_purge__discards_waiting_calls_as_it_discards_queued_messages(broker: Broker) -> None:
    """``app.control.purge()`` empties the broker: a pooled call still waiting goes too."""
    from tests.celery_app import app

    make_pool("warehouse", 1)
    running = add.delay(1, 2)  # admitted: its message is on the broker, purge takes it
    waiting = [add.delay(i, i) for i in range(3)]
    elsewhere = add.apply_async((9, 9), queue="not-consumed")  # routed to a queue not purged
    purged = app.control.purge()
    assert purged == 1 + 3, "the broker's message and the three waiting calls"
    states = dict(QueueEntry.objects.values_list("key", "state"))
    assert all(states[r.id] == EntryState.CANCELLED for r in waiting)
    assert states[elsewhere.id] == EntryState.WAITING
    assert states[running.id] == EntryState.ADMITTED  # its slot returns when its lease ends
    assert QueueEntry.objects.get(key=waiting[0].id).reason == "purged"
    assert waiting[0].state == "REVOKED"
    assert app.control.purge() == 0
