"""An enqueue inside the caller's ``transaction.atomic()`` takes no pool lock.

PostgreSQL (the only database where it applies; see ``admission._in_callers_transaction``),
on the fast path's and the ORM path's settings alike: inside a caller's transaction both
write the entry without the pool's row lock and admit it after the commit. Each lock
test has a sabotage twin that takes the old, locked path and shows the check fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction

from pools.core import admission, sweeps
from pools.exceptions import (
    DemandExceedsCapacity,
    PoolDraining,
    PoolFull,
    PoolPaused,
    UnknownPool,
)
from pools.models import DELAYED, Demand, EntryState, Pool, QueueEntry
from tests.bridge import RecordingBridge
from tests.conftest import POOL_APPS
from tests.factories import make_pool, submit

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True, available_apps=POOL_APPS),
]


@contextmanager
def other_session() -> Iterator[psycopg.Connection[Any]]:
    """A second session on the test database (another process, as far as locks go)."""
    d = connection.settings_dict
    con = psycopg.connect(
        dbname=d["NAME"], user=d["USER"], host=d["HOST"], port=d["PORT"], password=d["PASSWORD"]
    )
    try:
        yield con
    finally:
        con.rollback()
        con.close()


def pool_row_free(name: str) -> bool:
    """True if another session can take the pool's row lock at once (``NOWAIT``)."""
    with other_session() as con:
        try:
            con.execute("SELECT 1 FROM pools_pool WHERE name = %s FOR UPDATE NOWAIT", [name])
        except psycopg.errors.LockNotAvailable:
            return False
        return True


@pytest.mark.parametrize("locked_path", [False, True], ids=["no-lock", "sabotage-locked"])
def test_enqueue_in_atomic__pool_row_stays_free_until_commit(
    recorder: RecordingBridge,
    admission_path: str,
    monkeypatch: pytest.MonkeyPatch,
    locked_path: bool,
) -> None:
    if locked_path:  # the enqueue as it was: the pool lock held until the caller commits
        monkeypatch.setattr(admission, "_in_callers_transaction", lambda: False)
    make_pool("p", 1)
    with transaction.atomic():
        submit("p", key="a")
        free = pool_row_free("p")
        assert recorder.keys() == []
    assert free is not locked_path
    assert recorder.keys() == ["a"]
    assert QueueEntry.objects.get(key="a").state == EntryState.ADMITTED


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
        with other_session() as con:
            seen = con.execute("SELECT count(*) FROM pools_queueentry").fetchone()
        assert seen == (0,)
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
    import threading

    from django.db import connections

    done: list[BaseException | None] = []

    def work() -> None:
        try:
            submit("p", key=key)
            done.append(None)
        except BaseException as exc:  # pragma: no cover - reported below
            done.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(60)
    assert done == [None], done


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
    monkeypatch.setattr(admission, "_admit_after_commit", lambda names, due: None)
    with transaction.atomic():
        submit("p", key="a")
    assert recorder.keys() == []
    assert Pool.objects.get(name="p").next_due_at is None
    if not repair:
        monkeypatch.setattr(admission, "note_due_entries", lambda: 0)
    sweeps.sweep()
    assert (recorder.keys() == ["a"]) is repair
