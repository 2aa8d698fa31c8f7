"""Per-key pools: ``@pooled("tenant:{tenant_id}")`` creates one pool per key on first use."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone
from pytest_django import Settings

from pools.core import admission, definitions, per_key, pool_crud, sweeps
from pools.exceptions import PoolConfigurationError, PoolKeyError
from pools.models import Demand, Pool, PoolEvent, QueueEntry
from pools.states import EntryState, EventKind
from tests.conftest import POOL_APPS
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool
from tests.testapp.tasks import tenant_call, tenant_job

pytestmark = pytest.mark.django_db(transaction=True, available_apps=POOL_APPS)

TEMPLATES = {"tenant:{tenant_id}": {"slots": 1, "max_queued": 100}}


@pytest.fixture
def templates(settings: Settings, recorder: RecordingBridge) -> RecordingBridge:
    settings.POOLS = {**settings.POOLS, "TEMPLATES": TEMPLATES}
    return recorder


def _state(result: object) -> str:
    return str(QueueEntry.objects.get(key=result.id).state)  # type: ignore[attr-defined]


def test_first_use__creates_the_pool_from_its_template(templates: RecordingBridge) -> None:
    assert not Pool.objects.filter(name="tenant:acme").exists()
    result = tenant_job.delay("acme", 1)
    pool = Pool.objects.get(name="tenant:acme")
    assert (pool.slots, pool.max_queued, pool.template) == (1, 100, "tenant:{tenant_id}")
    entry = QueueEntry.objects.get(key=result.id)
    assert entry.demand == {"tenant:acme": 1}
    assert entry.state == EntryState.ADMITTED
    created = PoolEvent.objects.filter(kind=EventKind.POOL_CREATED, pool="tenant:acme")
    assert [e.detail["template"] for e in created] == ["tenant:{tenant_id}"]
    # The second use finds the pool: no second creation.
    tenant_job.delay("acme", 2)
    assert created.count() == 1


def test_pool_name__from_positional_keyword_and_send_task_arguments(
    templates: RecordingBridge,
) -> None:
    tenant_job.delay("pos")
    tenant_job.delay(tenant_id="kw")
    tenant_job.apply_async(args=("args",), kwargs={"n": 3})
    tenant_job.app.send_task(tenant_job.name, kwargs={"tenant_id": "byname"})
    names = set(Pool.objects.filter(template__gt="").values_list("name", flat=True))
    assert names == {"tenant:pos", "tenant:kw", "tenant:args", "tenant:byname"}


def test_missing_argument__is_a_clear_pool_error_and_writes_nothing(
    templates: RecordingBridge,
) -> None:
    with pytest.raises(PoolKeyError, match=r"tenant_id.*Pass tenant_id="):
        tenant_job.app.send_task(tenant_job.name, kwargs={"n": 1})
    with pytest.raises(PoolKeyError, match="not a valid pool name"):
        tenant_job.delay("has space")
    assert not Pool.objects.filter(name__startswith="tenant:").exists()
    assert not QueueEntry.objects.exists()


def test_pattern_without_template__names_the_setting_to_add(
    settings: Settings, recorder: RecordingBridge
) -> None:
    with pytest.raises(PoolConfigurationError, match=r"POOLS\['TEMPLATES'\]"):
        tenant_job.delay("acme")
    assert not Pool.objects.filter(name__startswith="tenant:").exists()


def test_isolation__one_tenants_backlog_does_not_block_another(
    templates: RecordingBridge,
) -> None:
    a = [tenant_job.delay("a", i) for i in range(3)]
    b = tenant_job.delay("b")
    assert [_state(r) for r in a] == ["admitted", "waiting", "waiting"]
    assert _state(b) == "admitted"


def test_multi_pool__global_and_per_tenant_pools_are_acquired_together(
    templates: RecordingBridge,
) -> None:
    """Atomic: an entry holds both pools or neither. The global pool keeps its line."""
    make_pool("global-api", 2)
    a1 = tenant_call.delay("a")
    a2 = tenant_call.delay("a")  # tenant a is full: a2 waits, holding nothing
    b1 = tenant_call.delay("b")  # behind a2 in global-api's line (head-of-line blocking)
    assert QueueEntry.objects.get(key=a1.id).demand == {"global-api": 1, "tenant:a": 1}
    assert [_state(r) for r in (a1, a2, b1)] == ["admitted", "waiting", "waiting"]
    assert Pool.objects.get(name="global-api").held == 1, "a2 took no global slot"
    assert Pool.objects.get(name="tenant:b").held == 0
    # a1 finishes: a2 then b1 take both of their pools at once; c waits for global-api.
    entry = QueueEntry.objects.get(key=a1.id)
    admission.settle(entry.queue_id, entry.token, "succeeded")
    c1 = tenant_call.delay("c")
    assert [_state(r) for r in (a2, b1, c1)] == ["admitted", "admitted", "waiting"]
    held = dict(Pool.objects.values_list("name", "held"))
    assert (held["global-api"], held["tenant:a"], held["tenant:b"], held["tenant:c"]) == (
        2,
        1,
        1,
        0,
    )


def _finish_all() -> None:
    for key in QueueEntry.objects.waiting().values_list("key", flat=True):
        admission.cancel(key)
    for entry in QueueEntry.objects.filter(state=EntryState.ADMITTED):
        admission.settle(entry.queue_id, entry.token, "succeeded")


def test_retirement__idle_per_key_pools_are_deleted_by_the_sweep(
    templates: RecordingBridge, settings: Settings
) -> None:
    settings.POOLS = {**settings.POOLS, "TEMPLATE_IDLE_SECONDS": 60}
    make_pool("hand-made", 1)
    tenant_job.delay("idle")
    tenant_job.delay("busy")
    tenant_job.delay("busy")  # waits
    _finish_all()
    tenant_job.delay("busy")  # waits again
    tenant_job.delay("busy")
    now = timezone.now()
    # Not idle long enough yet: nothing is retired.
    assert per_key.retire_idle(now + timedelta(seconds=30)) == []
    report = sweeps.sweep(now + timedelta(seconds=61))
    assert report.retired == ("tenant:idle",)
    left = set(Pool.objects.values_list("name", flat=True))
    assert "hand-made" in left and "tenant:busy" in left and "tenant:idle" not in left
    deleted = PoolEvent.objects.get(kind=EventKind.POOL_DELETED)
    assert (deleted.pool, deleted.actor) == ("tenant:idle", "")
    assert not Demand.objects.filter(pool__name="tenant:idle").exists()
    # Used again after its retirement: created again from the template.
    tenant_job.delay("idle")
    assert Pool.objects.get(name="tenant:idle").template == "tenant:{tenant_id}"


def test_retirement__a_pool_used_after_the_cutoff_is_kept(templates: RecordingBridge) -> None:
    tenant_job.delay("recent")
    _finish_all()
    pool = Pool.objects.get(name="tenant:recent")
    Pool.objects.filter(pk=pool.pk).update(created_at=timezone.now() - timedelta(hours=3))
    # Created long ago, but its entry finished within the idle timeout: kept.
    assert per_key.retire_idle(timezone.now() + timedelta(seconds=10)) == []
    assert per_key.retire_idle(timezone.now() + timedelta(hours=2)) == ["tenant:recent"]


def test_submit_after_retirement_between_check_and_enqueue__recreates_the_pool(
    templates: RecordingBridge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep may delete an idle pool after the submit found it and before it locks it."""
    tenant_job.delay("race")
    _finish_all()
    real_ensure = per_key.ensure_pool
    calls: list[str] = []

    def ensure_then_retire(name: str, pattern: str) -> Pool:
        pool = real_ensure(name, pattern)
        if not calls:
            pool_crud.delete_pool(name)
        calls.append(name)
        return pool

    monkeypatch.setattr(definitions, "ensure_pool", ensure_then_retire)  # the gate reads it there
    result = tenant_job.delay("race")
    assert _state(result) == "admitted" and len(calls) == 2


@pytest.mark.server_db
def test_concurrent_first_use__creates_one_pool(templates: RecordingBridge) -> None:
    """Eight threads (eight connections) use a new key at once: one pool, one creation.

    On PostgreSQL and MariaDB (real concurrent inserts; SQLite serializes writers).
    """
    threads = 8
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []
    pks: list[int] = []

    def first_use() -> None:
        try:
            barrier.wait()
            pks.append(per_key.ensure_pool("tenant:race", "tenant:{tenant_id}").pk)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connection.close()

    workers = [threading.Thread(target=first_use) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert errors == []
    assert len(set(pks)) == 1 and len(pks) == threads
    assert Pool.objects.filter(name="tenant:race").count() == 1
    assert PoolEvent.objects.filter(kind=EventKind.POOL_CREATED).count() == 1
