"""Fan-out in one transaction: ``pools.enqueue_many`` and groups of pooled calls
(:mod:`pools.celery.fanout`, :mod:`pools.core.fanout`), in-process (memory broker or Redis).

Each test that says a batch is atomic has a sabotage twin showing the same calls, sent
one by one, would leave part of the batch behind.
"""

from __future__ import annotations

from typing import cast
from unittest import mock

import pytest
from celery import chain, chord, group
from celery.result import GroupResult
from django.db import connection
from django.test.utils import CaptureQueriesContext

import pools
from pools.core import fanout
from pools.exceptions import PoolConfigurationError, PoolFull, PoolPaused, UnknownPool
from pools.models import Demand, EntryState, Pool, QueueEntry
from tests.conftest import POOL_APPS
from tests.support.factories import make_pool
from tests.testapp.tasks import add, both_pools, free_span, per_tenant, ship_order, tsum

pytestmark = pytest.mark.django_db(transaction=True, available_apps=POOL_APPS)


def _statements(queries: CaptureQueriesContext) -> list[str]:
    """The SQL run, upper case, without identifier quotes (any database)."""
    return [q["sql"].upper().replace('"', "").replace("`", "") for q in queries.captured_queries]


def _entries() -> list[QueueEntry]:
    return list(QueueEntry.objects.order_by("queue_id"))


def test_enqueue_many__order_kept_results_match_entries_and_cap_held(broker):
    make_pool("warehouse", 2)
    results = pools.enqueue_many([add.s(i, i) for i in range(7)])
    entries = _entries()
    assert [r.id for r in results] == [e.key for e in entries]
    assert [e.args for e in entries] == [[i, i] for i in range(7)]
    assert [e.state for e in entries] == [EntryState.ADMITTED] * 2 + [EntryState.WAITING] * 5
    # The admitted ones were published (after commit) with their claims, and only they.
    claims = sorted(h["pools_claim"] for h in broker.drain())
    assert claims == sorted(f"{e.queue_id}:{e.token}" for e in entries[:2])
    assert results[0].id == broker.seen[0]["id"] or results[1].id == broker.seen[0]["id"]


def _locks_pools(sql: str) -> bool:
    """A statement that locks pool rows (``FOR NO KEY UPDATE`` on PostgreSQL)."""
    return "FROM POOLS_POOL" in sql and ("FOR UPDATE" in sql or "FOR NO KEY UPDATE" in sql)


def test_enqueue_many__one_transaction_one_lock(broker):
    make_pool("warehouse", 1)
    with CaptureQueriesContext(connection) as queries:
        fanout_spy = mock.patch.object(fanout, "one_by_one", side_effect=AssertionError)
        with fanout_spy:
            pools.enqueue_many([add.s(i, 0) for i in range(20)])
    sql = _statements(queries)
    locks = [s for s in sql if _locks_pools(s)]
    inserts = [s for s in sql if s.startswith("INSERT INTO POOLS_QUEUEENTRY")]
    if connection.vendor == "postgresql":
        assert len(locks) == 1, locks
    assert len(inserts) == 1, "one bulk insert of the 20 entries"
    assert QueueEntry.objects.count() == 20


def test_enqueue_many__tuples_and_names(broker):
    make_pool("warehouse", 1)
    make_pool("partner-api", 1)
    results = pools.enqueue_many(
        [
            (add, (1, 2)),
            ("tests.testapp.tasks.add", [3, 4], {}),
            (tsum, ([1, 2],), {}, {"priority": 3}),
        ]
    )
    entries = _entries()
    assert [e.task_name for e in entries] == [
        "tests.testapp.tasks.add",
        "tests.testapp.tasks.add",
        "tests.testapp.tasks.tsum",
    ]
    assert [r.id for r in results] == [e.key for e in entries]


def test_enqueue_many__a_group_goes_through_one_batch(broker):
    make_pool("warehouse", 3)
    with mock.patch.object(fanout, "enqueue_many", wraps=fanout.enqueue_many) as spy:
        result = cast(GroupResult, group(add.s(i, 1) for i in range(10)).apply_async())
    assert spy.call_count == 1 and len(spy.call_args.args[0]) == 10
    entries = _entries()
    assert [r.id for r in (result.results or [])] == [e.key for e in entries]
    assert sum(e.state == EntryState.ADMITTED for e in entries) == 3


def test_enqueue_many__a_chord_header_goes_through_one_batch(broker):
    make_pool("warehouse", 5)
    make_pool("partner-api", 1)
    with mock.patch.object(fanout, "enqueue_many", wraps=fanout.enqueue_many) as spy:
        chord([add.s(i, 1) for i in range(4)])(tsum.s())
    assert spy.call_count == 1 and len(spy.call_args.args[0]) == 4
    header = QueueEntry.objects.filter(task_name="tests.testapp.tasks.add")
    assert header.count() == 4


def test_enqueue_many__mixed_group_sends_plain_members_as_celery_does(broker):
    make_pool("warehouse", 2)
    result = cast(GroupResult, group([add.s(1, 1), free_span.s(1, 0), add.s(2, 2)]).apply_async())
    assert QueueEntry.objects.count() == 2
    ids = [h["id"] for h in broker.drain()]
    assert (result.results or [])[1].id in ids  # the plain member went straight to the broker


def test_enqueue_many__multi_pool_set(broker):
    make_pool("warehouse", 2)
    make_pool("partner-api", 1)
    calls = [both_pools.s(0), add.s(1, 1), tsum.s([1]), both_pools.s(3), add.s(4, 4)]
    pools.enqueue_many(calls)
    entries = _entries()
    assert [e.demand for e in entries] == [
        {"warehouse": 1, "partner-api": 1},
        {"warehouse": 1},
        {"partner-api": 1},
        {"warehouse": 1, "partner-api": 1},
        {"warehouse": 1},
    ]
    # Line order kept in each pool: both_pools(0) holds one of each; add(1) the other slot.
    assert [e.state for e in entries] == [
        EntryState.ADMITTED,
        EntryState.ADMITTED,
        EntryState.WAITING,
        EntryState.WAITING,
        EntryState.WAITING,
    ]
    assert Demand.objects.count() == 7


def test_enqueue_many__idempotency_keys(broker):
    make_pool("warehouse", 1, paused=True)
    first = ship_order.delay(1)
    results = pools.enqueue_many(
        [ship_order.s(1), ship_order.s(2), ship_order.s(2), ship_order.s(3)]
    )
    assert results[0].id == first.id  # held by the entry sent before
    assert results[2].id == results[1].id  # the batch's own earlier call
    assert QueueEntry.objects.count() == 3
    keys = QueueEntry.objects.values_list("idempotency_key", flat=True).order_by("queue_id")
    assert list(keys) == ["order-1", "order-2", "order-3"]


@pytest.mark.parametrize("overflow", ["reject"])
def test_enqueue_many__max_queued_is_atomic(broker, overflow):
    make_pool("warehouse", 1, paused=True, max_queued=5, overflow=overflow)
    pools.enqueue_many([add.s(i, 0) for i in range(3)])
    with pytest.raises(PoolFull):
        pools.enqueue_many([add.s(i, 0) for i in range(3)])  # 6 > 5: none of the three
    assert QueueEntry.objects.count() == 3
    pools.enqueue_many([add.s(i, 0) for i in range(2)])  # 5 fits
    assert QueueEntry.objects.count() == 5


def test_enqueue_many__sabotage_one_by_one_keeps_part_of_the_batch(broker):
    """The twin of the test above: the same calls one at a time leave two of three."""
    make_pool("warehouse", 1, paused=True, max_queued=5)
    pools.enqueue_many([add.s(i, 0) for i in range(3)])
    with pytest.raises(PoolFull):
        for i in range(3):
            add.delay(i, 0)
    assert QueueEntry.objects.count() == 5


def test_enqueue_many__drop_oldest_overflow_behaves_as_single_calls(broker):
    make_pool("warehouse", 1, paused=True, max_queued=3, overflow="drop_oldest")
    pools.enqueue_many([add.s(i, 0) for i in range(5)])
    waiting = QueueEntry.objects.filter(state=EntryState.WAITING).order_by("queue_id")
    assert [e.args for e in waiting] == [[2, 0], [3, 0], [4, 0]]
    assert QueueEntry.objects.filter(state=EntryState.REJECTED).count() == 2


def test_enqueue_many__unknown_pool_and_paused_refuse_the_whole_batch(broker):
    make_pool("warehouse", 1)
    Pool.objects.filter(name="partner-api").delete()
    with pytest.raises(UnknownPool):
        pools.enqueue_many([add.s(1, 1), tsum.s([1])])  # no partner-api pool
    assert QueueEntry.objects.count() == 0
    make_pool("partner-api", 1, paused=True, paused_policy="reject")
    with pytest.raises(PoolPaused):
        pools.enqueue_many([add.s(1, 1), tsum.s([1])])
    assert QueueEntry.objects.count() == 0
    assert broker.drain() == []


def test_enqueue_many__a_failing_call_in_the_middle_enqueues_nothing(broker):
    make_pool("warehouse", 1)
    with pytest.raises(PoolConfigurationError):
        pools.enqueue_many(
            [add.s(1, 1), add.signature((2, 2), options={"pool_options": {"nope": 1}}), add.s(3, 3)]
        )
    assert QueueEntry.objects.count() == 0


@pytest.mark.parametrize(
    "bad",
    [
        [42],
        [(add,)],
        [(add, 1)],
        [(add, (1,), [])],
        [group(add.s(1, 1))],
        [free_span.s(1)],
        [chain(add.s(1, 1), add.s(2))],
    ],
    ids=[
        "not-a-call",
        "no-args",
        "args-not-a-list",
        "kwargs-not-a-dict",
        "a-group",
        "not-pooled",
        "a-chain",
    ],
)
def test_enqueue_many__bad_input_is_refused_before_anything_is_sent(broker, bad):
    make_pool("warehouse", 1)
    with pytest.raises((TypeError, PoolConfigurationError)) as raised:
        pools.enqueue_many([add.s(0, 0), *bad])
    assert "call 1" in str(raised.value)
    assert QueueEntry.objects.count() == 0
    assert broker.drain() == []


def test_enqueue_many__results_resolve_through_the_bridge(broker):
    """The AsyncResults are the entries' keys: what admission publishes under."""
    make_pool("warehouse", 10)
    results = pools.enqueue_many([add.s(i, i) for i in range(4)])
    published = {h["id"] for h in broker.drain()}
    assert published == {r.id for r in results}


def test_enqueue_many__chunks_bound_the_inserts(broker, monkeypatch):
    monkeypatch.setattr(fanout, "CHUNK", 3)
    make_pool("warehouse", 2)
    with CaptureQueriesContext(connection) as queries:
        results = pools.enqueue_many([add.s(i, 0) for i in range(8)])
    inserts = [s for s in _statements(queries) if s.startswith("INSERT INTO POOLS_QUEUEENTRY")]
    assert len(inserts) == 3  # 3 + 3 + 2
    assert [r.id for r in results] == [e.key for e in _entries()]
    assert [e.args for e in _entries()] == [[i, 0] for i in range(8)]


def test_enqueue_many__empty():
    assert pools.enqueue_many([]) == []
    assert Pool.objects.count() >= 0


def _order_of_statements(calls: list) -> list[str]:
    with CaptureQueriesContext(connection) as queries:
        pools.enqueue_many(calls)
    seen = []
    for sql in _statements(queries):
        if sql.startswith("INSERT INTO POOLS_QUEUEENTRY"):
            seen.append("entries")
        elif sql.startswith("INSERT INTO POOLS_DEMAND"):
            seen.append("line rows")
        elif _locks_pools(sql):
            seen.append("pool locks")
    return seen


@pytest.mark.server_db  # SQLite takes no row locks
def test_enqueue_many__wide_entry_rows_go_in_before_the_pool_locks(broker):
    """The pools are held for the line rows and the pass only; with idempotency keys the
    entries go in under the locks, as a single call's do."""
    make_pool("warehouse", 1)
    assert _order_of_statements([add.s(i, 0) for i in range(3)]) == [
        "entries",
        "pool locks",
        "line rows",
    ]
    assert _order_of_statements([ship_order.s(i) for i in range(3)]) == [
        "pool locks",
        "entries",
        "line rows",
    ]


def _rounds() -> list[tuple[int, int]]:
    rows = Demand.objects.filter(pool__name="tenants").order_by("entry_id")
    return [(row.entry.args[0], row.line_round) for row in rows.select_related("entry")]


def test_enqueue_many__fair_pool_rounds_as_single_calls(broker):
    """A ``fair`` pool takes the single-call rules inside the batch's transaction: the
    rounds are those of the same calls sent one by one."""
    make_pool("tenants", 1, paused=True, strategy="fair")
    tenants = [1, 1, 2, 1, 3, 2]
    for t in tenants:
        per_tenant.delay(t)
    one_by_one = _rounds()
    QueueEntry.objects.all().delete()
    make_pool("tenants", 1, paused=True, strategy="fair")
    pools.enqueue_many([per_tenant.s(t) for t in tenants])
    assert _rounds() == one_by_one
    assert [r for _, r in one_by_one] != [0] * len(tenants)  # the rounds differ at all


def test_enqueue_many__countdown_entries_are_delayed_and_the_pool_is_due(broker):
    make_pool("warehouse", 5)
    results = pools.enqueue_many(
        [add.s(1, 1), add.signature((2, 2), countdown=600), add.signature((3, 3), countdown=300)]
    )
    states = dict(Demand.objects.values_list("entry__key", "state"))
    assert states[results[0].id] != "delayed"
    assert states[results[1].id] == states[results[2].id] == "delayed"
    pool = Pool.objects.get(name="warehouse")
    third = QueueEntry.objects.get(key=results[2].id)
    assert pool.next_due_at == third.not_before  # the earlier of the two
    assert QueueEntry.objects.get(key=results[0].id).state == EntryState.ADMITTED
