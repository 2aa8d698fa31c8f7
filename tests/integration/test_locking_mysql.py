"""Locking behaviour of admission on MariaDB / MySQL (InnoDB, the ORM path).

* A transaction holding a pool row (``SELECT ... FOR UPDATE`` from a second connection)
  blocks admission on that pool until it ends (seen by the server as a lock wait).
* ``LOCK_TIMEOUT_SECONDS`` bounds the wait with the server's own session variables
  (``innodb_lock_wait_timeout``; ``max_statement_time`` on MariaDB, ``max_execution_time``
  on MySQL); the refusal is a :class:`PoolUnavailable` with a one-line reason, nothing
  is written, and the session's own values are back afterwards.
* A deadlock (another transaction locking pool rows in the opposite order) rolls back
  only the pools transaction: :class:`PoolUnavailable`, nothing written.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import connection, transaction
from pytest_django import Settings

from pools.core import admission, locking
from pools.exceptions import PoolUnavailable
from pools.models import Demand, EntryState, PoolEvent, QueueEntry
from tests.bridge import RecordingBridge
from tests.conftest import POOL_APPS
from tests.factories import make_pool, submit

pytestmark = [
    pytest.mark.mysql,
    pytest.mark.django_db(transaction=True, available_apps=POOL_APPS),
]

#: MariaDB's max_statement_time (1969), MySQL's max_execution_time (3024) or the lock
#: wait timeout (1205): whichever the server reports first.
TIMED_OUT = r"(max_statement_time exceeded|maximum statement execution time|Lock wait timeout)"


def with_pools_option(settings: Any, **options: Any) -> None:
    settings.POOLS = {**settings.POOLS, **options}


def raw_connection() -> Any:
    """A second server session (mysqlclient), outside Django."""
    import MySQLdb

    d = connection.settings_dict
    return MySQLdb.connect(
        host=d["HOST"],
        port=int(d["PORT"]),
        user=d["USER"],
        password=d["PASSWORD"],
        database=d["NAME"],
        autocommit=False,
    )


@contextmanager
def pool_rows_locked(*names: str) -> Iterator[Any]:
    """A second connection holding the row locks of pools ``names`` until the block ends."""
    con = raw_connection()
    try:
        cur = con.cursor()
        cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        for name in names:
            cur.execute("SELECT id FROM pools_pool WHERE name = %s FOR UPDATE", [name])
            assert cur.fetchone() is not None, f"no pool {name!r}"
        yield con
    finally:
        con.rollback()
        con.close()


def lock_waits() -> int:
    """Sessions of the test database waiting for a row lock right now.

    InnoDB refreshes ``INNODB_TRX`` only when it was not read for 100 ms: poll slower.
    """
    probe = raw_connection()
    try:
        cur = probe.cursor()
        cur.execute(
            "SELECT COUNT(*) FROM information_schema.INNODB_TRX t "
            "JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id "
            "WHERE t.trx_state = 'LOCK WAIT' AND p.DB = %s",
            [connection.settings_dict["NAME"]],
        )
        return int(cur.fetchone()[0])
    finally:
        probe.close()


def is_mariadb() -> bool:
    """MariaDB (``max_statement_time``), not MySQL (``max_execution_time``)."""
    return bool(getattr(connection, "mysql_is_mariadb", False))


def session_timeouts() -> tuple[int, float]:
    """``innodb_lock_wait_timeout`` and the statement bound of Django's session."""
    column = "@@SESSION.max_statement_time" if is_mariadb() else "@@SESSION.max_execution_time"
    with connection.cursor() as cur:
        cur.execute(f"SELECT @@SESSION.innodb_lock_wait_timeout, {column}")
        lock_wait, statement = cur.fetchone()
    return int(lock_wait), float(statement)


def set_session_timeouts(lock_wait: int, statement: float) -> None:
    column = "max_statement_time" if is_mariadb() else "max_execution_time"
    with connection.cursor() as cur:
        cur.execute(
            f"SET SESSION innodb_lock_wait_timeout = %s, SESSION {column} = %s",
            [lock_wait, statement],
        )


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.25)


class InThread:
    """Run ``fn`` in a thread with its own Django connection."""

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
            connection.close()
            self.done.set()

    def join(self, timeout: float) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"thread still running after {timeout}s"
        if self.error is not None:
            raise self.error
        return self.result


def nothing_written(events_before: int) -> None:
    assert not QueueEntry.objects.exists()
    assert not Demand.objects.exists()
    assert PoolEvent.objects.count() == events_before


# --------------------------------------------------------------------------- blocking


def test_held_pool_lock__blocks_enqueue_until_released(
    recorder: RecordingBridge, settings: Settings
) -> None:
    with_pools_option(settings, LOCK_TIMEOUT_SECONDS=60)
    make_pool("p", 1)
    with pool_rows_locked("p") as locker:
        job = InThread(lambda: submit("p", key="blocked"))
        wait_for(lambda: lock_waits() == 1, 10, "enqueue to wait on the row lock")
        assert not job.done.wait(1.0), "enqueue completed while the pool row was locked"
        assert recorder.keys() == []
        locker.rollback()
        assert job.done.wait(10), "enqueue did not complete after the lock was released"
    assert job.join(5).admitted
    assert recorder.keys() == ["blocked"]


def test_multi_pool_enqueue__waits_for_every_pool_it_names(
    recorder: RecordingBridge, settings: Settings
) -> None:
    with_pools_option(settings, LOCK_TIMEOUT_SECONDS=60)
    make_pool("a", 1)
    make_pool("b", 1)
    with pool_rows_locked("b") as locker:
        job = InThread(lambda: submit({"a": 1, "b": 1}, key="both"))
        wait_for(lambda: lock_waits() == 1, 10, "enqueue to wait on pool b")
        assert not job.done.wait(0.5)
        locker.rollback()
        assert job.done.wait(10)
    assert job.join(5).admitted
    assert recorder.keys() == ["both"]


# --------------------------------------------------------------------------- the bound


def test_lock_timeout__enqueue_raises_one_line_pool_unavailable_and_writes_nothing(
    recorder: RecordingBridge, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    with_pools_option(settings, LOCK_TIMEOUT_SECONDS=0.5)
    make_pool("p", 2)
    events_before = PoolEvent.objects.count()
    with pool_rows_locked("p"), caplog.at_level(logging.INFO, logger="pools.locking"):
        began = time.monotonic()
        with pytest.raises(PoolUnavailable, match=TIMED_OUT) as caught:
            submit("p", key="timed-out")
        waited = time.monotonic() - began
    # MariaDB cuts the wait at max_statement_time (0.5 s); MySQL at the lock wait timeout
    # rounded up to whole seconds (1 s).
    assert 0.4 <= waited < 5, f"waited {waited:.2f}s for a 0.5s bound"
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("pool state is unavailable (pools p): ")
    assert "LOCK_TIMEOUT_SECONDS (0.5s)" in message, message
    # The driver's own error stays available: as the cause, and in the log.
    assert caught.value.__cause__ is not None
    code = caught.value.__cause__.args[0]
    assert code in {1205, 1969, 3024}, caught.value.__cause__
    assert any(str(code) in r.getMessage() for r in caplog.records), caplog.text
    nothing_written(events_before)
    assert recorder.keys() == []
    assert submit("p", key="after").admitted  # the connection is usable again


def test_lock_timeout__settle_behind_a_held_pool_row(
    recorder: RecordingBridge, settings: Settings
) -> None:
    """Where settles combine (docs/concepts/contention.md), one behind a held pool row
    settles at once and leaves the slot to the pool's next lock holder; on MySQL/MariaDB
    (no combining) it raises at the bound with the claim still held."""
    from pools.core import locking

    make_pool("p", 1)
    submit("p", key="run")
    submit("p", key="next")
    with_pools_option(settings, LOCK_TIMEOUT_SECONDS=0.5)
    run = recorder.admissions[0]
    if not locking.combining():  # MySQL/MariaDB settle under the lock (see combining())
        events_before = PoolEvent.objects.count()
        with pool_rows_locked("p"), pytest.raises(PoolUnavailable, match=TIMED_OUT):
            admission.settle(run.entry_id, run.token, "succeeded")
        assert QueueEntry.objects.get(key="run").state == EntryState.ADMITTED
        assert PoolEvent.objects.count() == events_before
        assert admission.settle(run.entry_id, run.token, "succeeded")
        assert recorder.keys() == ["run", "next"]
        return
    with pool_rows_locked("p"):
        assert admission.settle(run.entry_id, run.token, "succeeded")
    assert QueueEntry.objects.get(key="run").state == EntryState.SUCCEEDED
    assert QueueEntry.objects.get(key="next").state == EntryState.WAITING
    assert not admission.settle(run.entry_id, run.token, "succeeded")
    admission.admit(["p"])
    assert recorder.keys() == ["run", "next"]


#: A submit that ends the older waiting entries of its job: it locks its pools even inside
#: a caller's transaction (a plain call there does not: test_enqueue_in_transaction.py).
REPLACE_JOB: dict[str, Any] = {"job": "j", "concurrency_policy": "replace"}


def test_lock_timeout__inside_the_callers_transaction_leaves_it_usable(
    recorder: RecordingBridge, settings: Settings
) -> None:
    make_pool("p", 1)
    make_pool("other", 1)
    with_pools_option(settings, LOCK_TIMEOUT_SECONDS=0.5)
    with transaction.atomic():
        submit("other", key="kept")  # no pool lock inside a transaction: admitted at commit
        # A call that ends other entries (a "replace" job) still takes the pool's lock.
        with pool_rows_locked("p"), pytest.raises(PoolUnavailable, match=TIMED_OUT):
            submit("p", key="timed-out", **REPLACE_JOB)
        assert list(QueueEntry.objects.values_list("key", flat=True)) == ["kept"]
    assert recorder.keys() == ["kept"]
    assert not QueueEntry.objects.filter(key="timed-out").exists()


def test_bound__is_set_during_the_pools_transaction_only(
    recorder: RecordingBridge, settings: Settings
) -> None:
    """The session's own timeouts are back after a pools operation, refused or not."""
    with_pools_option(settings, LOCK_TIMEOUT_SECONDS=2.5)
    make_pool("p", 1)
    set_session_timeouts(17, 9)
    with locking.locked_pools(["p"]):
        inside = session_timeouts()
    statement = 2.5 if is_mariadb() else 2500
    assert inside == (3, statement), "lock wait rounded up to whole seconds"
    assert session_timeouts() == (17, 9)
    assert submit("p", key="a").admitted
    assert session_timeouts() == (17, 9)
    # After a refusal (lock timeout), and inside a caller's transaction, too.
    with_pools_option(settings, LOCK_TIMEOUT_SECONDS=0.5)
    with pool_rows_locked("p"), pytest.raises(PoolUnavailable):
        submit("p", key="refused")
    assert session_timeouts() == (17, 9)
    with transaction.atomic():
        submit("p", key="nested", **REPLACE_JOB)  # under the pool's lock (see above)
        assert session_timeouts() == (17, 9)
    set_session_timeouts(50, 0)


def test_bound__nested_pools_transactions_restore_once() -> None:
    set_session_timeouts(21, 0)
    with locking.bounded("outer"):
        outer = session_timeouts()
        with locking.bounded("inner"):
            pass
        assert session_timeouts() == outer, "the inner block does not restore the outer's"
    assert outer[0] == 5  # LOCK_TIMEOUT_SECONDS default 5.0
    assert session_timeouts() == (21, 0)
    set_session_timeouts(50, 0)


# --------------------------------------------------------------------------- deadlock


def test_deadlock__rolls_back_the_pools_transaction_only(
    recorder: RecordingBridge, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """Another transaction locks b then a while enqueue holds a and waits for b.

    InnoDB breaks the cycle by rolling back the lighter transaction: the other one has
    written rows first, so the enqueue is the victim. It surfaces as a one-line
    PoolUnavailable, nothing of the entry is written, and the other transaction goes on.
    """
    with_pools_option(settings, LOCK_TIMEOUT_SECONDS=30)
    make_pool("a", 1)
    make_pool("b", 1)
    events_before = PoolEvent.objects.count()
    other = raw_connection()
    try:
        cur = other.cursor()
        cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        cur.execute("SELECT id FROM pools_pool WHERE name = 'b' FOR UPDATE")
        cur.execute("UPDATE pools_pool SET slots = slots WHERE name = 'b'")
        # Undo records make this transaction the heavier one: InnoDB picks the other.
        cur.execute("CREATE TEMPORARY TABLE heavy (n int) ENGINE=InnoDB")
        cur.executemany("INSERT INTO heavy VALUES (%s)", [(i,) for i in range(200)])
        job = InThread(lambda: submit({"a": 1, "b": 1}, key="victim"))
        wait_for(lambda: lock_waits() == 1, 10, "enqueue to hold a and wait for b")
        with caplog.at_level(logging.INFO, logger="pools.locking"):
            cur.execute("SELECT id FROM pools_pool WHERE name = 'a' FOR UPDATE")  # the cycle
            assert job.done.wait(10)
        with pytest.raises(PoolUnavailable, match="Deadlock") as caught:
            job.join(5)
        other.commit()
    finally:
        other.close()
    message = str(caught.value)
    assert "\n" not in message
    assert "rolling this transaction back; retry" in message, message
    assert caught.value.__cause__ is not None and caught.value.__cause__.args[0] == 1213
    assert "1213" in caplog.text
    nothing_written(events_before)
    assert recorder.keys() == []
    assert submit({"a": 1, "b": 1}, key="retried").admitted


# --------------------------------------------------------------------------- plans


def test_entry_update__reads_and_writes_by_primary_key_only(recorder: RecordingBridge) -> None:
    """Entry updates lock rows by primary key, then update by primary key only.

    MariaDB may run ``UPDATE ... WHERE queue_id = A AND state = 'admitted' AND token = 1``
    through the state index, locking other entries' index records on the way: in the
    contention proof two workers starting two different entries deadlocked that way
    (error 1213, InnoDB's deadlock report showed both waiting in
    ``pools_entry_state_lease``). ``update_by_primary_key`` reads the rows with a
    ``SELECT ... FOR UPDATE`` (a constant lookup by primary key) and the ``UPDATE``
    names primary keys only, which the server can only read through the primary key.
    """
    from django.test.utils import CaptureQueriesContext

    make_pool("p", 2)
    assert submit("p", key="a").admitted and submit("p", key="b").admitted
    a = QueueEntry.objects.get(key="a").pk
    claim = QueueEntry.objects.filter(pk=a, state=EntryState.ADMITTED, token=1)
    with transaction.atomic(), CaptureQueriesContext(connection) as ctx:
        assert claim.update(worker="w1") == 1
    select, update = (q["sql"] for q in ctx.captured_queries)
    assert select.startswith("SELECT") and select.endswith("FOR UPDATE"), select
    assert update.startswith("UPDATE"), update
    where = update.split(" WHERE ", 1)[1]
    assert where == f"`pools_queueentry`.`queue_id` IN ({a})", where
    with connection.cursor() as cur:
        cur.execute(f"EXPLAIN {update}")
        columns = [c[0] for c in cur.description]
        plan = dict(zip(columns, cur.fetchone(), strict=True))
    assert plan["key"] == "PRIMARY", plan
    assert QueueEntry.objects.get(pk=a).worker == "w1"
    assert QueueEntry.objects.get(key="b").worker == ""


def test_line_query__is_served_by_the_line_index(recorder: RecordingBridge) -> None:
    """The head of a 2,000-entry line is read through ``pools_demand_line``, no filesort
    (MariaDB >= 10.8 keeps the index's ``priority DESC``)."""
    from tests.integration.test_locking import bulk_waiting

    make_pool("p", 1)
    submit("p", key="run")
    bulk_waiting("p", 2000)
    with connection.cursor() as cur:
        cur.execute("ANALYZE TABLE pools_demand")
    pool_id = QueueEntry.objects.get(key="run").demands.get().pool_id
    query = Demand.objects.line(pool_id).select_related("entry")[:1]
    with connection.cursor() as cur:
        sql, params = query.query.sql_with_params()
        cur.execute(f"EXPLAIN {sql}", params)
        columns = [c[0] for c in cur.description]
        plan = [dict(zip(columns, row, strict=True)) for row in cur.fetchall()]
    demand = next(p for p in plan if p["table"] == "pools_demand")
    assert demand["key"] == "pools_demand_line", plan
    assert "filesort" not in str(demand["Extra"]).lower(), plan
