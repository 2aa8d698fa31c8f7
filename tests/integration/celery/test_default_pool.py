"""The implicit default pool: unpooled tasks routed to its queues are admitted through it."""

from __future__ import annotations

import pytest
from pytest_django import Settings

from pools.celery import default_pool
from pools.core import declarations, settings_sync
from pools.models import Pool, QueueEntry
from pools.states import EntryState
from tests.conftest import POOL_APPS
from tests.support.bridge import RecordingBridge
from tests.testapp.tasks import add, free_span

pytestmark = pytest.mark.django_db(transaction=True, available_apps=POOL_APPS)

DEFAULT = {"name": "default", "slots": 1, "queues": ["celery"]}


@pytest.fixture
def default_on(settings: Settings, recorder: RecordingBridge) -> RecordingBridge:
    settings.POOLS = {**settings.POOLS, "DEFAULT_POOL": DEFAULT}
    settings_sync.sync()
    return recorder


def test_sync__creates_the_default_pool_as_a_settings_pool(default_on: RecordingBridge) -> None:
    pool = Pool.objects.get(name="default")
    assert (pool.slots, pool.defined_in_settings) == (1, True)


def test_unpooled_task_on_a_default_queue__waits_for_the_default_pool(
    default_on: RecordingBridge,
) -> None:
    first = free_span.delay(1)
    second = free_span.delay(2)
    entries = [QueueEntry.objects.get(key=r.id) for r in (first, second)]
    assert [e.demand for e in entries] == [{"default": 1}, {"default": 1}]
    assert [e.state for e in entries] == [EntryState.ADMITTED, EntryState.WAITING]
    assert [a.key for a in default_on.admissions] == [first.id]


def test_other_queue_and_pooled_tasks__keep_their_own_way(default_on: RecordingBridge) -> None:
    other = free_span.apply_async((1,), queue="elsewhere")
    pooled = add.delay(1, 2)
    assert not QueueEntry.objects.filter(key=other.id).exists(), "not a default-pool queue"
    assert QueueEntry.objects.get(key=pooled.id).demand == {"warehouse": 1}


def test_off_by_default__unpooled_tasks_are_not_held(
    settings: Settings, recorder: RecordingBridge
) -> None:
    assert declarations.default_pool() is None
    result = free_span.delay(1)
    assert not QueueEntry.objects.filter(key=result.id).exists()


def test_celery_and_pools_tasks__never_go_through_the_default_pool(
    default_on: RecordingBridge,
) -> None:
    from tests.celery_app import app

    assert default_pool.default_spec(app, "pools.sweep", (), {}, {}) is None
    assert default_pool.default_spec(app, "celery.chord_unlock", (), {}, {}) is None
    spec = default_pool.default_spec(app, free_span.name, (1,), {}, {})
    assert spec is not None and spec.demand == {"default": 1}
