"""Workflow caps (issue 15): a task cap (``@pooled(max_running=N)``) and a run cap
(``pools.limit_run``), through the gate, on both admission paths.

Real workers and a 500-member group: ``tests/acceptance/test_caps_workers.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import group
from celery.utils import uuid

import pools
from pools.core import admission, explain, per_key, pool_crud
from pools.exceptions import PoolConfigurationError
from pools.models import Pool, QueueEntry
from pools.pool_names import RUN_CAP_PREFIX, TASK_CAP_PREFIX, cap_pool_name
from pools.states import EntryState
from tests.conftest import POOL_APPS
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool
from tests.testapp import tasks

add: Any = tasks.add
capped_add: Any = tasks.capped_add
capped_span: Any = tasks.capped_span
run_member: Any = tasks.run_member

pytestmark = pytest.mark.django_db(transaction=True, available_apps=POOL_APPS)

TASK_CAP = f"{TASK_CAP_PREFIX}{capped_span.name}"


@pytest.fixture
def paths(admission_path: str, recorder: RecordingBridge) -> RecordingBridge:
    """Both admission paths (PostgreSQL runs each test on the SQL and the ORM path)."""
    return recorder


def settle(rec: RecordingBridge, key: str) -> bool:
    adm = [a for a in rec.admissions if a.key == key][-1]
    return admission.settle(adm.entry_id, adm.token, "succeeded")


# --------------------------------------------------------------------------- task cap


def test_task_cap__at_most_n_admitted_then_the_next_on_settle(paths: RecordingBridge) -> None:
    calls = [capped_span.delay(i) for i in range(5)]
    assert paths.keys() == [c.id for c in calls[:3]]
    pool = Pool.objects.get(name=TASK_CAP)
    assert (pool.slots, pool.template) == (3, "task-cap:{task}")
    entry = QueueEntry.objects.get(key=calls[3].id)
    assert entry.demand == {TASK_CAP: 1}
    why = explain.explain_key(calls[3].id)
    assert why.blocked_by == "task_cap"
    assert "task cap (max_running)" in why.places[0].message
    assert settle(paths, calls[0].id)
    assert paths.keys() == [c.id for c in calls[:4]]


def test_task_cap__composes_with_a_named_pool_and_is_reported_first(
    paths: RecordingBridge,
) -> None:
    make_pool("warehouse", 1)
    first = capped_add.delay(1, 1)
    second = capped_add.delay(2, 2)
    assert paths.keys() == [first.id]
    cap = f"{TASK_CAP_PREFIX}{capped_add.name}"
    assert QueueEntry.objects.get(key=second.id).demand == {cap: 1, "warehouse": 1}
    why = explain.explain_key(second.id)
    # Both gates are full; the task cap comes before the named pool.
    assert [p.pool for p in why.places] == [cap, "warehouse"]
    assert [p.blocked_by for p in why.places] == ["task_cap", "pool_full"]
    assert why.blocked_by == "task_cap"
    # A larger warehouse does not help: the task cap still holds the second call back.
    make_pool("warehouse", 5)
    admission.admit(["warehouse"])
    assert paths.keys() == [first.id]
    assert settle(paths, first.id)
    assert paths.keys() == [first.id, second.id]


def test_ordered_gates__an_entry_held_by_its_cap_does_not_block_the_named_pool(
    paths: RecordingBridge,
) -> None:
    """Run cap -> task cap -> named pools: a call waiting for its task cap is not in the
    named pool's line yet, so later calls of other tasks are admitted there; when the cap
    has room it is first in line again (its place is its enqueue time)."""
    make_pool("warehouse", 3)
    first = capped_add.delay(1, 1)  # task cap 1: admitted
    capped = [capped_add.delay(i, i) for i in range(2, 5)]  # held by the task cap
    plain = add.delay(9, 9)  # behind them in warehouse's line, but they are not in it yet
    assert paths.keys() == [first.id, plain.id]
    why = explain.explain_key(capped[0].id)
    assert why.blocked_by == "task_cap"
    assert settle(paths, first.id)  # the cap has room: the oldest capped call goes next
    assert paths.keys() == [first.id, plain.id, capped[0].id]
    assert settle(paths, plain.id)
    assert paths.keys() == [first.id, plain.id, capped[0].id]  # still at its cap
    assert settle(paths, capped[0].id)
    assert paths.keys() == [first.id, plain.id, capped[0].id, capped[1].id]


def test_ordered_gates__a_capped_head_whose_cap_has_room_blocks_as_usual(
    paths: RecordingBridge,
) -> None:
    """Through its cap (room), a waiting entry is in the named pool's line: head-of-line
    order holds there as for any entry."""
    make_pool("warehouse", 1)
    blocker = add.delay(0, 0)
    capped = capped_add.delay(1, 1)  # its task cap has room; warehouse is full
    later = add.delay(2, 2)
    assert paths.keys() == [blocker.id]
    assert explain.explain_key(capped.id).blocked_by == "pool_full"
    assert settle(paths, blocker.id)
    assert paths.keys() == [blocker.id, capped.id]
    assert explain.explain_key(later.id).blocked_by == "pool_full"


def test_task_cap__a_changed_max_running_drains_to_the_new_capacity(
    paths: RecordingBridge,
) -> None:
    calls = [capped_span.delay(i) for i in range(4)]  # 3 admitted, 1 waits
    assert len(paths.keys()) == 3
    per_key.ensure_cap_pool(TASK_CAP, 1, template="task-cap:{task}")  # a new deploy
    pool = Pool.objects.get(name=TASK_CAP)
    assert (pool.slots, pool.pending_slots) == (3, 1)  # the entry in line drains first
    for c in calls[:3]:
        settle(paths, c.id)
    assert paths.keys()[-1] == calls[3].id
    settle(paths, calls[3].id)
    assert Pool.objects.get(name=TASK_CAP).slots == 1


def test_task_cap__validated_at_decoration() -> None:
    with pytest.raises(PoolConfigurationError, match="max_running"):
        pools.pooled(max_running=0)
    with pytest.raises(PoolConfigurationError, match="needs a pool name"):
        pools.pooled()


@pytest.mark.parametrize("name", ["run-cap:mine", "task-cap:x"])
def test_cap_prefixes_are_reserved(name: str) -> None:
    with pytest.raises(PoolConfigurationError, match="reserved for workflow caps"):
        pools.pooled(name)
    with pytest.raises(PoolConfigurationError, match="reserved for workflow caps"):
        pool_crud.create_pool(name=name, slots=1)


def test_cap_pool_name__long_or_odd_keys_become_valid_unique_names() -> None:
    a = cap_pool_name(TASK_CAP_PREFIX, "x" * 150)
    b = cap_pool_name(TASK_CAP_PREFIX, "x" * 151)
    assert len(a) <= 100 and len(b) <= 100 and a != b
    assert cap_pool_name(TASK_CAP_PREFIX, "app.tasks.run me") != cap_pool_name(
        TASK_CAP_PREFIX, "app.tasks.run_me"
    )


# --------------------------------------------------------------------------- run cap


def test_run_cap__a_group_has_at_most_n_members_admitted(paths: RecordingBridge) -> None:
    make_pool(tasks.BULK_POOL, 50)
    result = pools.limit_run(group(run_member.s(i) for i in range(6)), max_running=2)
    members = [r.id for r in result.results]
    assert paths.keys() == members[:2]
    root = QueueEntry.objects.get(key=members[0]).root_id
    cap = f"{RUN_CAP_PREFIX}{root}"
    assert Pool.objects.get(name=cap).slots == 2
    waiting = QueueEntry.objects.get(key=members[2])
    assert waiting.demand == {tasks.BULK_POOL: 1, cap: 1}
    why = explain.explain_key(members[2])
    assert why.blocked_by == "run_cap"
    assert why.places[0].pool == cap  # the run cap comes first
    for key in members:
        assert settle(paths, key)
    assert paths.keys() == members
    assert QueueEntry.objects.filter(state=EntryState.SUCCEEDED).count() == 6


def test_run_cap__tasks_started_by_the_workflow_inherit_it(paths: RecordingBridge) -> None:
    """A child call carries the workflow's root id (Celery passes it down): it is capped
    by the same pool; another workflow's calls are not, and pass it in the shared pool
    (the child is not in ``bulk``'s line until its run cap has room)."""
    make_pool(tasks.BULK_POOL, 50)
    result = pools.limit_run(run_member.s(1), max_running=1)
    root = QueueEntry.objects.get(key=result.id).root_id
    assert root and root != result.id
    child = run_member.apply_async((2,), root_id=root, parent_id=result.id)
    other = run_member.apply_async((3,), root_id=uuid(), parent_id=uuid())
    assert paths.keys() == [result.id, other.id]
    assert explain.explain_key(child.id).blocked_by == "run_cap"
    assert QueueEntry.objects.get(key=other.id).demand == {tasks.BULK_POOL: 1}
    assert settle(paths, result.id)
    assert paths.keys() == [result.id, other.id, child.id]


def test_run_cap__plain_calls_do_no_cap_lookup(
    paths: RecordingBridge, django_assert_max_num_queries: Any
) -> None:
    """A call that is its own root needs no look-up: the usual path is unchanged."""
    make_pool("warehouse", 5)
    add.delay(1, 1)  # warm-up (per-process caches)
    with django_assert_max_num_queries(20) as ctx:
        add.delay(1, 2)
    assert not any("run-cap:" in q["sql"] for q in ctx.captured_queries)


def test_run_cap__validates_max_running() -> None:
    with pytest.raises(PoolConfigurationError, match="max_running"):
        pools.limit_run(add.s(1, 1), max_running=0)
