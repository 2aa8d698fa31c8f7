"""Locking behaviour of admission on PostgreSQL, and its query cost.

* A transaction holding a pool row (``SELECT ... FOR UPDATE`` from a second connection)
  blocks admission on that pool until it ends; with ``LOCK_TIMEOUT_SECONDS`` the wait is
  bounded and surfaces as :class:`PoolUnavailable` with nothing written. (On the
  PostgreSQL engine a settle or enqueue of a one-pool entry outside a transaction does
  not wait: it leaves its work to the holder, tests/integration/pg/test_owed_work.py; the
  tests here use entries of two pools where that matters.)
* The admission query count is pinned, and does not grow with the length of the line.

Enqueue and settle run two ways on PostgreSQL: one call of a stored function
(enqueue and settle of ``pools/pg/sql/schema.sql``: the default fast path) and the portable ORM
path (``SQL_FAST_PATH=False``); the tests run on both (``admission_path``).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.db import DatabaseError, connection
from django.db.models import QuerySet
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from pytest_django import DjangoAssertNumQueries, Settings

from pools.core import admission
from pools.core.records import Enqueued
from pools.exceptions import PoolUnavailable
from pools.models import Demand, Pool, PoolEvent, QueueEntry
from pools.states import EntryState
from tests.conftest import POOL_APPS
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True, available_apps=POOL_APPS),
]

#: Queries of one enqueue that is admitted at once (BEGIN and COMMIT included), per path.
# The ORM path's counts went down with the lean hot path: no event rows
# for enqueued/admitted/started/settled (-1 INSERT each) and the held slots read from the
# locked pool row instead of a SUM over the demand rows (-1 SELECT), for one UPDATE of the
# pool's held counter per change of its holders (+1). On PostgreSQL each admission pass
# of the ORM path then takes the work owed to its lock holder first (one statement, +1:
# pools.core.held.apply_owed; none on other databases).
ENQUEUE_ADMITTED = {"sql": 1, "orm": 11}
#: Queries of one enqueue into a full pool (the entry waits), per path.
ENQUEUE_WAITING = {"sql": 1, "orm": 7}
#: Queries of one settle that admits its successor(s), per path.
SETTLE_AND_ADMIT = {"sql": 1, "orm": 14}
#: Queries of one settle with nobody waiting, per path.
SETTLE_ALONE = {"sql": 1, "orm": 11}
#: The server cancels the lock wait (lock_timeout and statement_timeout are set equal,
#: so either may be the one reported).
LOCK_TIMED_OUT = r"canceling statement due to (lock|statement) timeout"


def with_pools_option(settings: Any, **options: Any) -> None:
    settings.POOLS = {**settings.POOLS, **options}


# --------------------------------------------------------------------------- helpers


@contextmanager
def pool_row_locked(name: str) -> Iterator[psycopg.Connection[Any]]:
    """A second connection holding the row lock of pool ``name`` until the block ends.

    ``rollback()`` on the yielded connection releases it early.
    """
    d = connection.settings_dict
    con = psycopg.connect(
        dbname=d["NAME"], user=d["USER"], host=d["HOST"], port=d["PORT"], password=d["PASSWORD"]
    )
    try:
        row = con.execute("SELECT id FROM pools_pool WHERE name = %s FOR UPDATE", [name]).fetchone()
        assert row is not None, f"no pool {name!r}"
        yield con
    finally:
        con.rollback()
        con.close()


def sessions_blocked_by(con: psycopg.Connection[Any]) -> int:
    """How many server sessions are waiting on a lock held by ``con``'s session."""
    with psycopg.connect(conninfo=con.info.dsn, autocommit=True) as probe:
        row = probe.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
            [con.info.backend_pid],
        ).fetchone()
    assert row is not None
    return int(row[0])


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


class InThread:
    """Run ``fn`` in a thread with its own Django connection; ``done`` is set when it ends."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:
            self.error = exc
        finally:
            connection.close()  # this thread's connection
            self.done.set()

    def join(self, timeout: float) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"thread still running after {timeout}s"
        if self.error is not None:
            raise self.error
        return self.result


def bulk_waiting(pool_name: str, count: int, *, seed: int = 3) -> list[QueueEntry]:
    """``count`` waiting entries of 1 slot in ``pool_name``, created in bulk.

    Rows are exactly what enqueue writes for a waiting entry (an entry row plus its
    demand row). Priorities are random and many entries share ``enqueued_at``, so the
    order of the line is decided by the full key (priority, enqueued_at, queue_id).
    """
    pool = Pool.objects.get(name=pool_name)
    rng = random.Random(seed)
    base = timezone.now() - timedelta(hours=1)
    entries = QueueEntry.objects.bulk_create(
        QueueEntry(
            key=f"bulk-{pool_name}-{i}",
            task_name="tests.fake",
            demand={pool_name: 1},
            priority=rng.randint(0, 3),
            enqueued_at=base + timedelta(seconds=rng.randint(0, count // 10)),
        )
        for i in range(count)
    )
    Demand.objects.bulk_create(
        Demand(entry=e, pool=pool, slots=1, priority=e.priority, enqueued_at=e.enqueued_at)
        for e in entries
    )
    return entries


def head_of(entries: list[QueueEntry]) -> QueueEntry:
    """The entry admission must pick: priority desc, then enqueued_at, then queue_id."""
    return min(entries, key=lambda e: (-e.priority, e.enqueued_at, e.queue_id))


def settle_key(rec: Any, key: str, outcome: str = "succeeded") -> bool:
    adm = next(a for a in rec.admissions if a.key == key)
    return admission.settle(adm.entry_id, adm.token, outcome)


# --------------------------------------------------------------------------- (a) blocking


def test_held_pool_lock__blocks_enqueue_until_released(
    recorder: RecordingBridge, settings: Settings, admission_path: str
) -> None:
    with_pools_option(settings, LOCK_TIMEOUT_SECONDS=60)
    make_pool("p", 1)
    with pool_row_locked("p") as locker:
        job = InThread(lambda: submit("p", key="blocked"))
        # The enqueue is waiting on our row lock (seen by the server), not just slow.
        wait_for(lambda: sessions_blocked_by(locker) == 1, 10, "enqueue to wait on the lock")
        assert not job.done.wait(1.0), "enqueue completed while the pool row was locked"
        assert not QueueEntry.objects.exists()
        assert recorder.keys() == []
        locker.rollback()  # release
        assert job.done.wait(10), "enqueue did not complete after the lock was released"
    result: Enqueued = job.join(5)
    assert result.admitted
    assert recorder.keys() == ["blocked"]
    assert QueueEntry.objects.get(key="blocked").state == EntryState.ADMITTED


def test_held_pool_lock__blocks_settle_until_released(
    recorder: RecordingBridge, settings: Settings, admission_path: str
) -> None:
    with_pools_option(settings, LOCK_TIMEOUT_SECONDS=60)
    make_pool("p", 1)
    make_pool("q", 1)
    # Two pools: a settle of a one-pool entry on the PostgreSQL engine does not wait, it
    # leaves its release to the lock holder (tests/integration/pg/test_owed_work.py).
    submit({"p": 1, "q": 1}, key="run")
    submit({"p": 1, "q": 1}, key="next")
    with pool_row_locked("p") as locker:
        job = InThread(lambda: settle_key(recorder, "run"))
        wait_for(lambda: sessions_blocked_by(locker) == 1, 10, "settle to wait on the lock")
        assert not job.done.wait(1.0), "settle completed while the pool row was locked"
        assert QueueEntry.objects.get(key="run").state == EntryState.ADMITTED
        locker.rollback()
        assert job.done.wait(10), "settle did not complete after the lock was released"
    assert job.join(5) is True
    assert recorder.keys() == ["run", "next"]


def test_multi_pool_enqueue__waits_for_every_pool_it_names(
    recorder: RecordingBridge, settings: Settings, admission_path: str
) -> None:
    with_pools_option(settings, LOCK_TIMEOUT_SECONDS=60)
    make_pool("a", 1)
    make_pool("b", 1)
    with pool_row_locked("b") as locker:
        job = InThread(lambda: submit({"a": 1, "b": 1}, key="both"))
        wait_for(lambda: sessions_blocked_by(locker) == 1, 10, "enqueue to wait on pool b")
        assert not job.done.wait(0.5)
        locker.rollback()
        assert job.done.wait(10)
    assert job.join(5).admitted
    assert recorder.keys() == ["both"]


# --------------------------------------------------------------------------- (b) timeout


def test_lock_timeout__enqueue_raises_pool_unavailable_and_writes_nothing(
    recorder: RecordingBridge, settings: Settings, admission_path: str
) -> None:
    with_pools_option(settings, LOCK_TIMEOUT_SECONDS=0.5)
    make_pool("p", 2)
    events_before = PoolEvent.objects.count()
    with pool_row_locked("p"):
        began = time.monotonic()
        with pytest.raises(PoolUnavailable, match=LOCK_TIMED_OUT):
            submit("p", key="timed-out")
        waited = time.monotonic() - began
    assert 0.4 <= waited < 5, f"waited {waited:.2f}s for a 0.5s lock timeout"
    assert not QueueEntry.objects.exists()
    assert not Demand.objects.exists()
    assert PoolEvent.objects.count() == events_before
    assert recorder.keys() == []
    # The connection is usable again and, with the lock gone, the same call succeeds.
    assert submit("p", key="after").admitted
    assert recorder.keys() == ["after"]


def test_lock_timeout__settle_raises_and_the_claim_is_still_held(
    recorder: RecordingBridge, settings: Settings, admission_path: str
) -> None:
    make_pool("p", 1)
    make_pool("q", 1)
    submit({"p": 1, "q": 1}, key="run")  # two pools: see the test above
    submit({"p": 1, "q": 1}, key="next")
    with_pools_option(settings, LOCK_TIMEOUT_SECONDS=0.5)
    events_before = PoolEvent.objects.count()
    with pool_row_locked("p"), pytest.raises(PoolUnavailable, match=LOCK_TIMED_OUT):
        settle_key(recorder, "run")
    assert QueueEntry.objects.get(key="run").state == EntryState.ADMITTED
    assert QueueEntry.objects.get(key="next").state == EntryState.WAITING
    assert PoolEvent.objects.count() == events_before
    # A retry after the lock is gone settles it (exactly once) and admits the next.
    assert settle_key(recorder, "run")
    assert recorder.keys() == ["run", "next"]


def test_inside_the_callers_transaction__enqueue_waits_for_no_pool_lock(
    recorder: RecordingBridge, settings: Settings, admission_path: str
) -> None:
    """In ``transaction.atomic()`` an enqueue takes no pool lock: another session holding
    the pool's row does not make it wait (before, this raised ``PoolUnavailable`` after
    the bound); both calls are admitted after the caller commits."""
    from django.db import transaction

    make_pool("p", 1)
    make_pool("other", 1)
    with_pools_option(settings, LOCK_TIMEOUT_SECONDS=0.5)
    with transaction.atomic():
        assert not submit("other", key="kept").admitted, "admitted after the commit"
        with pool_row_locked("p"):
            submit("p", key="behind-a-lock")
        assert sorted(QueueEntry.objects.values_list("key", flat=True)) == [
            "behind-a-lock",
            "kept",
        ]
        assert recorder.keys() == [], "nothing is published before the caller commits"
    assert sorted(recorder.keys()) == ["behind-a-lock", "kept"]


def test_inside_the_callers_transaction__a_refusal_leaves_it_usable(
    recorder: RecordingBridge, settings: Settings, admission_path: str
) -> None:
    """A refused enqueue in ``transaction.atomic()`` rolls back only its own work."""
    from django.db import transaction

    from pools.exceptions import PoolFull

    make_pool("p", 1, max_queued=1)
    make_pool("other", 1)
    submit("p", key="run")
    submit("p", key="waits")
    with transaction.atomic():
        submit("other", key="kept")
        with pytest.raises(PoolFull):
            submit("p", key="refused")
        # The caller's transaction is still usable and keeps what it did before.
        assert "kept" in QueueEntry.objects.values_list("key", flat=True)
    assert recorder.keys() == ["run", "kept"]
    assert not QueueEntry.objects.filter(key="refused").exists()


# --------------------------------------------------------------------------- (c) query count


def test_queries__enqueue_into_free_pool(
    recorder: RecordingBridge,
    admission_path: str,
    django_assert_num_queries: DjangoAssertNumQueries,
) -> None:
    make_pool("p", 2)
    with django_assert_num_queries(ENQUEUE_ADMITTED[admission_path]):
        assert submit("p", key="a").admitted


def test_queries__enqueue_into_full_pool(
    recorder: RecordingBridge,
    admission_path: str,
    django_assert_num_queries: DjangoAssertNumQueries,
) -> None:
    make_pool("p", 1)
    submit("p", key="run")
    with django_assert_num_queries(ENQUEUE_WAITING[admission_path]):
        assert not submit("p", key="wait").admitted


def test_queries__settle_admits_one_successor(
    recorder: RecordingBridge,
    admission_path: str,
    django_assert_num_queries: DjangoAssertNumQueries,
) -> None:
    make_pool("p", 1)
    submit("p", key="run")
    submit("p", key="next")
    with django_assert_num_queries(SETTLE_AND_ADMIT[admission_path]):
        assert settle_key(recorder, "run")
    assert recorder.keys() == ["run", "next"]


def test_queries__settle_with_empty_line(
    recorder: RecordingBridge,
    admission_path: str,
    django_assert_num_queries: DjangoAssertNumQueries,
) -> None:
    make_pool("p", 1)
    submit("p", key="run")
    with django_assert_num_queries(SETTLE_ALONE[admission_path]):
        assert settle_key(recorder, "run")


def test_queries__settle_admitting_three_costs_the_same_as_one(
    recorder: RecordingBridge,
    admission_path: str,
    django_assert_num_queries: DjangoAssertNumQueries,
) -> None:
    make_pool("p", 3)
    submit("p", 3, key="big")
    for k in ("x", "y", "z"):
        submit("p", key=k)
    with django_assert_num_queries(SETTLE_AND_ADMIT[admission_path]):
        assert settle_key(recorder, "big")
    assert recorder.keys() == ["big", "x", "y", "z"]


def _settle_cost(rec: Any, pool: str, waiting: int) -> tuple[int, float]:
    """Queries and seconds of one settle+admit in ``pool`` with ``waiting`` entries in line."""
    make_pool(pool, 1)
    submit(pool, key=f"run-{pool}")
    entries = bulk_waiting(pool, waiting)
    expected = head_of(entries)
    with CaptureQueriesContext(connection) as ctx:
        began = time.perf_counter()
        assert settle_key(rec, f"run-{pool}")
        took = time.perf_counter() - began
    # The successor is the head by (priority desc, enqueued_at, queue_id), whatever the DB.
    admitted = QueueEntry.objects.get(state=EntryState.ADMITTED, demands__pool__name=pool)
    assert admitted.pk == expected.pk, (admitted.key, expected.key)
    assert rec.keys()[-1] == expected.key
    return len(ctx.captured_queries), took


def test_queries__settle_cost_does_not_depend_on_line_length(
    recorder: RecordingBridge, admission_path: str
) -> None:
    short, short_s = _settle_cost(recorder, "short", 10)
    long, long_s = _settle_cost(recorder, "long", 2000)
    print(
        f"\nsettle+admit: 10 waiting -> {short} queries {short_s * 1000:.1f}ms; "
        f"2000 waiting -> {long} queries {long_s * 1000:.1f}ms"
    )
    assert short == long == SETTLE_AND_ADMIT[admission_path]


@pytest.mark.parametrize("waiting", [10, 2000])
def test_queries__enqueue_cost_does_not_depend_on_line_length(
    recorder: RecordingBridge,
    admission_path: str,
    waiting: int,
    django_assert_num_queries: DjangoAssertNumQueries,
) -> None:
    make_pool("p", 1)
    submit("p", key="run")
    bulk_waiting("p", waiting)
    with django_assert_num_queries(ENQUEUE_WAITING[admission_path]):
        assert not submit("p", key="one-more").admitted


def test_line_query__is_served_by_the_line_index(recorder: RecordingBridge) -> None:
    """The head lookup is an index range scan, not a scan and sort of the whole line."""
    make_pool("p", 1)
    submit("p", key="run")
    bulk_waiting("p", 2000)
    with connection.cursor() as cur:
        cur.execute("ANALYZE pools_demand")
    pool_id = QueueEntry.objects.get(key="run").demands.get().pool_id
    plan = Demand.objects.line(pool_id).select_related("entry")[:1].explain()
    assert "pools_demand_line" in plan, plan
    assert "Sort" not in plan, plan


def _plan_without_seqscan(queryset: Any) -> str:
    """The plan of ``queryset`` when PostgreSQL may not scan the table (size-independent)."""
    with connection.cursor() as cur:
        cur.execute("SET enable_seqscan = off")
    try:
        return str(queryset.explain())
    finally:
        with connection.cursor() as cur:
            cur.execute("RESET enable_seqscan")


def test_partial_indexes__serve_the_queries_that_use_them(recorder: RecordingBridge) -> None:
    """Each partial index's condition (``QueueEntry.Meta.indexes``) is implied by the
    queries it is for.

    The conditions keep index entries (and WAL) out of most row versions: a waiting entry
    has no lease, a running one no finish time. A query whose filter did not imply the
    condition would silently scan the table instead.
    """
    now = timezone.now()
    held = QueueEntry.objects.held()
    cases: dict[str, list[QuerySet[Any]]] = {
        "pools_entry_lease": [
            held.filter(lease_expires_at__lt=now),  # lapsed leases (sweeps.reclaim)
            held.filter(lease_expires_at__lt=now).order_by("lease_expires_at")[:1],
        ],
        "pools_entry_deadline": [  # admission.expire_due
            QueueEntry.objects.waiting()
            .filter(deadline__lte=now, finished_at__isnull=True)
            .order_by("deadline")[:500]
        ],
        "pools_entry_finished": [  # sweeps.prune
            QueueEntry.objects.filter(state__in=["succeeded", "failed"], finished_at__lt=now)
        ],
        "pools_entry_root": [QueueEntry.objects.filter(root_id="a-workflow-root")],
        "pools_entry_key": [QueueEntry.objects.filter(key="a-task-id")],
        "pools_event_pool": [PoolEvent.objects.filter(pool="p")],
    }
    for index, querysets in cases.items():
        for queryset in querysets:
            plan = _plan_without_seqscan(queryset)
            assert index in plan, (index, str(queryset.query), plan)


# --------------------------------------------------------------------------- sweep vs start


def test_sweep__does_not_requeue_a_claim_started_after_it_read_the_lapsed_leases(
    recorder: RecordingBridge,
) -> None:
    from unittest import mock

    from pools.core import leases, sweeps

    make_pool("p", 1)
    submit("p", key="late-msg")
    submit("p", key="next")
    # The message sat in the broker: its lease lapsed before a worker picked it up.
    QueueEntry.objects.filter(key="late-msg").update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )
    real_requeue = admission.requeue
    claims: list[Any] = []

    def worker_starts_first(entry_id: int, token: int, **kw: Any) -> bool:
        # A worker starts the entry between the sweep's read and its requeue.
        claims.append(leases.start(entry_id, token, worker="w1"))
        return real_requeue(entry_id, token, **kw)

    with mock.patch.object(admission, "requeue", worker_starts_first):
        sweeps.sweep()
    assert claims and claims[0] is not None, "the worker's start succeeded: its body runs"
    entry = QueueEntry.objects.get(key="late-msg")
    # The running attempt must keep its claim: one body, one slot, no second admission.
    assert (entry.state, entry.token) == (EntryState.RUNNING, 1)
    assert recorder.keys() == ["late-msg"]


# --------------------------------------------------------------------------- frozen holder


def test_idle_bound__set_on_pools_own_transactions_only(settings: Settings) -> None:
    from django.db import transaction

    from pools.core import locking

    with_pools_option(settings, LOCK_TIMEOUT_SECONDS=0.5)
    make_pool("p", 1)

    def idle_timeout() -> str:
        with connection.cursor() as cursor:
            cursor.execute("SHOW idle_in_transaction_session_timeout")
            return str(cursor.fetchone()[0])

    with locking.locked_pools(["p"]):
        assert idle_timeout() == "500ms"  # LOCK_TIMEOUT_SECONDS (IDLE_BOUND_FACTOR = 1)
        with connection.cursor() as cursor:  # the server gives up on unacknowledged data too
            cursor.execute("SHOW tcp_user_timeout")
            assert cursor.fetchone()[0] == "500"  # (milliseconds, shown without a unit)
    with transaction.atomic(), locking.locked_pools(["p"]):
        # Inside the caller's own transaction: the caller's to bound.
        assert idle_timeout() == "0"


def test_idle_bound__a_frozen_lock_holder_loses_its_session_and_the_pool_goes_on(
    recorder: RecordingBridge, settings: Settings
) -> None:
    """A process frozen inside a pools transaction (as SIGSTOP does) holds the pool's row
    lock; after LOCK_TIMEOUT_SECONDS idle the server ends its session, and others take
    the lock while it is still frozen."""
    from pools.core import locking

    with_pools_option(settings, LOCK_TIMEOUT_SECONDS=0.3)
    make_pool("p", 1)
    frozen_for = 3.0

    def frozen_holder() -> None:
        with locking.locked_pools(["p"]):
            time.sleep(frozen_for)  # idle in transaction, holding the lock

    holder = InThread(frozen_holder)
    started = time.monotonic()
    time.sleep(0.1)
    with connection.cursor() as cursor, pytest.raises(DatabaseError):  # the lock is held
        cursor.execute("SELECT 1 FROM pools_pool WHERE name = 'p' FOR UPDATE NOWAIT")
    time.sleep(1.2)  # past the idle bound (0.3 s): the server has ended the session
    assert submit("p", key="late").admitted
    assert time.monotonic() - started < frozen_for  # ... while the holder still sleeps
    with pytest.raises(PoolUnavailable):  # the holder finds its session gone on waking
        holder.join(10)
