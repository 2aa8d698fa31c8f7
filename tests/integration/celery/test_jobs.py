"""Manual start of a periodic task (pools.celery.jobs.start_job) through the gate."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from celery import signals
from django_celery_beat.models import IntervalSchedule, PeriodicTask
from pytest_django import Settings

from pools.celery import jobs
from pools.exceptions import JobNotFound, PoolFull
from pools.models import QueueEntry
from pools.states import EntryState, Origin
from tests.conftest import POOL_APPS
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool
from tests.testapp.tasks import add

pytestmark = pytest.mark.django_db(transaction=True, available_apps=POOL_APPS)


#: (task id, headers, routing key, properties) of one published message.
Published = tuple[str | None, dict[str, Any], str | None, dict[str, Any] | None]


def periodic(name: str, task: str, **kw: Any) -> PeriodicTask:
    every, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.HOURS)
    return PeriodicTask.objects.create(name=name, task=task, interval=every, **kw)


@pytest.fixture
def published() -> Iterator[list[Published]]:
    """(task id, headers, routing) of every message really published."""
    seen: list[Published] = []

    def grab(
        sender: Any = None,
        headers: dict[str, Any] | None = None,
        routing_key: str | None = None,
        properties: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        seen.append(((headers or {}).get("id"), dict(headers or {}), routing_key, properties))

    signals.before_task_publish.connect(grab, weak=False)
    yield seen
    signals.before_task_publish.disconnect(grab)


def test_start_job__pooled_task_is_queued_with_its_args_options_and_origin(
    recorder: RecordingBridge, published: list[Published]
) -> None:
    make_pool("warehouse", 1)
    periodic(
        "nightly-add",
        add.name,
        args=json.dumps([2, 3]),
        kwargs=json.dumps({}),
        queue="exports",
        priority=4,
        headers=json.dumps({"tenant": "t1"}),
    )
    started = jobs.start_job("nightly-add")
    entry = QueueEntry.objects.get(key=started.key)
    assert started == jobs.JobStarted(
        queued=True, key=entry.key, queue_id=entry.queue_id, pool="warehouse", pools=["warehouse"]
    )
    assert (entry.task_name, entry.args, entry.kwargs) == (add.name, [2, 3], {})
    assert entry.origin == Origin.MANUAL
    # Celery built the message (held in line by the gate) from the job's options.
    ((task_id, headers, routing_key, properties),) = published
    assert properties is not None
    assert (task_id, routing_key, properties["priority"]) == (entry.key, "exports", 4)
    assert (headers["tenant"], headers["periodic_task_name"]) == ("t1", "nightly-add")
    assert entry.state == EntryState.ADMITTED and recorder.keys() == [entry.key]


def test_start_job__multi_pool_task_reports_every_pool(
    recorder: RecordingBridge, settings: Settings
) -> None:
    settings.POOLS = {**settings.POOLS, "TASKS": {"tests.multi": {"pools": {"b": 1, "a": 2}}}}
    make_pool("a", 2)
    make_pool("b", 1)
    periodic("multi", "tests.multi")
    started = jobs.start_job("multi", origin=Origin.API)
    assert (started.queued, started.pool, started.pools) == (True, "a", ["a", "b"])
    assert QueueEntry.objects.get(key=started.key).origin == Origin.API


@pytest.mark.redis
def test_start_job__unpooled_task_is_published_at_once(published: list[Published]) -> None:
    periodic("plain", "tests.not_pooled", kwargs=json.dumps({"x": 1}))
    started = jobs.start_job("plain")
    assert started == jobs.JobStarted(queued=False, key=started.key)
    assert [p[0] for p in published] == [started.key]
    assert published[0][1]["periodic_task_name"] == "plain"
    assert not QueueEntry.objects.exists()


def test_start_job__unknown_job() -> None:
    with pytest.raises(JobNotFound, match="No periodic task named 'ghost'") as info:
        jobs.start_job("ghost")
    assert info.value.code == "job_not_found"


def test_start_job__pool_refusal_propagates(recorder: RecordingBridge) -> None:
    make_pool("warehouse", 1, max_queued=1)
    periodic("nightly-add", add.name, args="[1, 1]")
    jobs.start_job("nightly-add")  # admitted
    jobs.start_job("nightly-add")  # waits: the backlog is full now
    with pytest.raises(PoolFull) as info:
        jobs.start_job("nightly-add")
    assert info.value.code == "pool_full"
    assert QueueEntry.objects.count() == 2
