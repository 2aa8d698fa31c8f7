"""An enqueue inside the caller's ``transaction.atomic()`` takes no lock others wait on.

On PostgreSQL (the fast path's and the ORM path's settings alike) and on MariaDB/MySQL
(the ORM path): inside a caller's transaction the entry and its line rows are written
without the pool's row lock and admitted after the commit. On InnoDB the line rows'
foreign key to the pool would take a shared lock on the pool row at the insert; it is
not checked there (see ``locking.parent_rows_unlocked``). Each lock test has a sabotage
twin that takes the old, locked path (or, on MariaDB, checks the foreign key at the
insert) and shows the check fails.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import pytest
from django.db import connection, connections, transaction
from pytest_django import Settings

from pools.core import admission, in_transaction, locking, sweeps
from pools.exceptions import (
    DemandExceedsCapacity,
    PoolDraining,
    PoolFull,
    PoolPaused,
    UnknownPool,
)
from pools.models import Demand, Pool, QueueEntry
from pools.states import DELAYED, EntryState
from tests.conftest import POOL_APPS
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = [
    pytest.mark.server_db,
    pytest.mark.django_db(transaction=True, available_apps=POOL_APPS),
]

#: "Could not lock at once" from ``FOR UPDATE NOWAIT``: PostgreSQL's SQLSTATE, MariaDB's
#: lock wait timeout (1205) and MySQL's ER_LOCK_NOWAIT (3572).
_NOWAIT = ("55P03", 1205, 3572)


@contextmanager
def other_session() -> Iterator[Any]:
    """A second session on the test database (another process, as far as locks go): a
    DB-API connection of the driver, outside Django."""
    d = connection.settings_dict
    if connection.vendor == "postgresql":
        import psycopg

        con: Any = psycopg.connect(
            dbname=d["NAME"], user=d["USER"], host=d["HOST"], port=d["PORT"], password=d["PASSWORD"]
        )
    else:
        from tests.integration.core.test_locking_mysql import raw_connection

        con = raw_connection()
    try:
        yield con
    finally:
        con.rollback()
        con.close()


def _code(exc: BaseException) -> object:
    return getattr(exc, "sqlstate", None) or (exc.args[0] if exc.args else None)


def pool_row_free(name: str) -> bool:
    """True if another session can take the pool's row lock at once (``NOWAIT``)."""
    with other_session() as con:
        cur = con.cursor()
        try:
            cur.execute("SELECT 1 FROM pools_pool WHERE name = %s FOR UPDATE NOWAIT", [name])
        except Exception as exc:
            if _code(exc) in _NOWAIT:
                return False
            raise
        return True


def entries_seen_elsewhere() -> int:
    with other_session() as con:
        cur = con.cursor()
        cur.execute("SELECT count(*) FROM pools_queueentry")
        return int(cur.fetchone()[0])


def sabotage(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """``locked``: the enqueue as it was (the pool lock held until the caller commits);
    ``fk-checked``: on InnoDB, the line rows' foreign keys checked at the insert."""
    if how == "locked":
        monkeypatch.setattr(admission, "in_callers_transaction", lambda: False)
    elif how == "fk-checked":
        monkeypatch.setattr(in_transaction, "parent_rows_unlocked", nullcontext)


#: The sabotage twins of a lock test on this database.
SABOTAGES = [
    "none",
    "locked",
    *(["fk-checked"] if os.environ.get("POOLS_TEST_DB") == "mysql" else []),
]


@pytest.mark.parametrize("how", SABOTAGES, ids=lambda h: h if h == "none" else f"sabotage-{h}")
def test_enqueue_in_atomic__pool_row_stays_free_until_commit(
    recorder: RecordingBridge, admission_path: str, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    sabotage(monkeypatch, how)
    make_pool("p", 1)
    with transaction.atomic():
        submit("p", key="a")
        free = pool_row_free("p")
        assert recorder.keys() == []
    assert free is (how == "none")
    assert recorder.keys() == ["a"]
    assert QueueEntry.objects.get(key="a").state == EntryState.ADMITTED


@pytest.mark.parametrize("how", SABOTAGES, ids=lambda h: h if h == "none" else f"sabotage-{h}")
def test_enqueue_in_atomic__other_sessions_enqueue_and_settle_go_on_before_commit(
    recorder: RecordingBridge,
    admission_path: str,
    monkeypatch: pytest.MonkeyPatch,
    settings: Settings,
    how: str,
) -> None:
    """While the caller's transaction is open, another session settles the pool's running
    call and enqueues another, each in its own transaction (a worker, another view): both
    are done before the caller commits. With the lock held they wait out
    ``LOCK_TIMEOUT_SECONDS`` and fail (ORM path), or (PostgreSQL engine) leave their work
    to the lock holder, the caller, which admits only after its commit, and in line
    order: its own entry, not the other session's."""
    sabotage(monkeypatch, how)
    settings.POOLS = {**settings.POOLS, "LOCK_TIMEOUT_SECONDS": 2.0}
    make_pool("p", 1)
    run = submit("p", key="run")
    token = QueueEntry.objects.get(pk=run.entry_id).token
    with transaction.atomic():
        submit("p", key="inside")
        errors = elsewhere(
            lambda: admission.settle(run.entry_id, token, "succeeded"),
            lambda: submit("p", key="other"),
        )
    done_before_commit = errors == [] and recorder.keys() == ["run", "other"]
    assert done_before_commit is (how == "none"), (errors, recorder.keys())
    if how == "none":
        assert QueueEntry.objects.get(key="inside").state == EntryState.WAITING


def test_enqueue_in_atomic__rollback_leaves_no_entry_and_publishes_nothing(
    recorder: RecordingBridge, admission_path: str
) -> None:
    make_pool("p", 1)

    class Boom(Exception):
        pass

    with pytest.raises(Boom), transaction.atomic():
        submit("p", key="a")
        raise Boom
    assert not QueueEntry.objects.filter(key="a").exists()
    assert not Demand.objects.exists()
    assert recorder.keys() == []
    assert Pool.objects.get(name="p").next_due_at is None
    submit("p", key="b")  # the pool works on, from an empty line
    assert recorder.keys() == ["b"]


def test_enqueue_in_atomic__before_commit_others_see_nothing_and_it_waits_out_of_line(
    recorder: RecordingBridge, admission_path: str
) -> None:
    make_pool("p", 1)
    with transaction.atomic():
        entry_id = submit("p", key="a").entry_id
        # Inside the caller's transaction: written, out of line until the commit.
        assert Demand.objects.get(entry_id=entry_id).state == DELAYED
        assert entries_seen_elsewhere() == 0
    assert Demand.objects.get(entry_id=entry_id).state == EntryState.ADMITTED


@pytest.mark.parametrize(
    ("pool", "demand", "error"),
    [
        ({}, {"nope": 1}, UnknownPool),
        ({"slots": 1}, {"p": 2}, DemandExceedsCapacity),
        ({"slots": 1, "paused": True, "paused_policy": "reject"}, {"p": 1}, PoolPaused),
        ({"slots": 1, "pending_slots": 3}, {"p": 1}, PoolDraining),
        ({"slots": 1, "max_queued": 1}, {"p": 1}, PoolFull),
    ],
)
def test_enqueue_in_atomic__refusals_are_raised_in_the_call(
    recorder: RecordingBridge, admission_path: str, pool: dict[str, Any], demand: Any, error: type
) -> None:
    """Decided without locks from the committed state, in the same precedence."""
    if pool:
        make_pool("p", **{"slots": 1, **pool})
    if "max_queued" in pool:
        submit("p", key="run")
        submit("p", key="waits")
    with transaction.atomic():
        with pytest.raises(error):
            submit(demand, key="refused")
        assert not QueueEntry.objects.filter(key="refused").exists()
    assert not QueueEntry.objects.filter(key="refused").exists()


def test_enqueue_in_atomic__full_pool_that_drops_takes_the_locked_path(
    recorder: RecordingBridge, admission_path: str
) -> None:
    """An overflow drop ends another entry: it needs the pool lock, as before."""
    make_pool("p", 1, max_queued=1, overflow="drop_oldest")
    submit("p", key="run")
    submit("p", key="old")
    with transaction.atomic():
        submit("p", key="new")
        assert not pool_row_free("p")
    assert QueueEntry.objects.get(key="old").state == EntryState.REJECTED
    assert QueueEntry.objects.get(key="new").state == EntryState.WAITING


def test_enqueue_in_atomic__takes_its_place_by_the_time_of_the_call(
    recorder: RecordingBridge, admission_path: str
) -> None:
    """FIFO: a call made inside a transaction is ahead of calls made after it, elsewhere,
    before its commit."""
    make_pool("p", 1, strategy="fifo")
    submit("p", key="run")
    with transaction.atomic():
        submit("p", key="inside")
        _submit_elsewhere("later")  # another connection's call, committed before ours
    assert recorder.keys() == ["run"]
    run = recorder.admissions[0]
    assert admission.settle(run.entry_id, run.token, "succeeded")
    assert recorder.keys() == ["run", "inside"]


def _submit_elsewhere(key: str) -> None:
    """A submit committed by another thread (its own connection, autocommit)."""
    assert elsewhere(lambda: submit("p", key=key)) == []


def elsewhere(*calls: Callable[[], object]) -> list[BaseException]:
    """Run ``calls`` one after the other in another thread (its own connection, each in
    its own transaction); the errors they raised."""
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for call in calls:
                try:
                    call()
                except Exception as exc:
                    errors.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(120)
    assert not thread.is_alive()
    return errors


@pytest.mark.parametrize("repair", [True, False], ids=["sweep", "sabotage-no-repair"])
def test_enqueue_in_atomic__the_sweep_admits_it_if_the_caller_died_after_commit(
    recorder: RecordingBridge,
    admission_path: str,
    monkeypatch: pytest.MonkeyPatch,
    repair: bool,
) -> None:
    """A process that dies between its commit and the admission after it leaves an entry
    out of line with no ``next_due_at``: the sweep finds it (without that step, never)."""
    make_pool("p", 1)
    monkeypatch.setattr(in_transaction, "admit_after_commit", lambda names, due: None)
    with transaction.atomic():
        submit("p", key="a")
    assert recorder.keys() == []
    assert Pool.objects.get(name="p").next_due_at is None
    if not repair:
        monkeypatch.setattr(admission, "note_due_entries", lambda: 0)
    sweeps.sweep()
    assert (recorder.keys() == ["a"]) is repair


# --------------------------------------------------------------------------- MariaDB/MySQL


def _foreign_key_checks() -> int:
    with connection.cursor() as cur:
        cur.execute("SELECT @@SESSION.foreign_key_checks")
        return int(cur.fetchone()[0])


@pytest.mark.mysql
@pytest.mark.parametrize("session", [1, 0])
def test_enqueue_in_atomic__session_foreign_key_checks_are_back_after_the_call(
    recorder: RecordingBridge, session: int
) -> None:
    """The keys are unchecked for the line rows' insert only: the caller's session has its
    own setting back right after the call, and after an error inside the insert."""
    make_pool("p", 1)

    class Boom(Exception):
        pass

    with connection.cursor() as cur:
        cur.execute("SET SESSION foreign_key_checks = %s", [session])
    try:
        with transaction.atomic():
            submit("p", key="a")
            assert _foreign_key_checks() == session
            with pytest.raises(Boom), locking.parent_rows_unlocked():
                assert _foreign_key_checks() == 0
                raise Boom
            assert _foreign_key_checks() == session
    finally:
        with connection.cursor() as cur:
            cur.execute("SET SESSION foreign_key_checks = 1")
    assert recorder.keys() == ["a"]


@pytest.mark.mysql
def test_enqueue_in_atomic__pool_deleted_before_the_insert_is_refused_as_unknown(
    recorder: RecordingBridge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The keys are not checked at the insert, so the pools are read again after it: a
    pool deleted by another session after the call read it is refused (nothing written),
    not left with line rows pointing at no pool."""
    make_pool("p", 1)
    make_pool("gone", 1)
    real = in_transaction.demand_rows

    def rows_then_delete(*args: Any, **kwargs: Any) -> list[Demand]:
        rows = real(*args, **kwargs)
        assert elsewhere(lambda: Pool.objects.filter(name="gone").delete()) == []
        return rows

    monkeypatch.setattr(in_transaction, "demand_rows", rows_then_delete)
    with transaction.atomic():
        with pytest.raises(UnknownPool, match="gone"):
            submit({"p": 1, "gone": 1}, key="a")
        assert not Pool.objects.filter(name="gone").exists()
    assert not QueueEntry.objects.filter(key="a").exists()
    assert not Demand.objects.exists()
    assert recorder.keys() == []
