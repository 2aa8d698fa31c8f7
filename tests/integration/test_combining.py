"""A settler that finds its pool row locked leaves the admission to the lock's holder
(docs/concepts/contention.md), and no wake-up is lost.

A second thread (its own database connection) holds the pool's row lock while the test
settles the pool's only holder: the settle must return without waiting, its slot owed
(``releasing``), and the waiting entry must be admitted once the holder's transaction ends,
by the holder's post-release re-check. The sabotage twin removes that re-check: the entry
then waits with the pool's slot free (a lost wake-up), which the proof must see.

Both engines on PostgreSQL (the settle function and the ORM engine). SQLite serializes
writers and MySQL/MariaDB settle under the lock (``locking.combining``): skipped there.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from django.db import connection, connections
from pytest_django import Settings

from pools.core import admission, locking
from pools.models import RELEASING, Demand, EntryState, Pool, QueueEntry
from tests.bridge import RecordingBridge
from tests.conftest import POOL_APPS, _admission_paths
from tests.factories import make_pool, submit

pytestmark = pytest.mark.django_db(transaction=True, available_apps=POOL_APPS)


@pytest.fixture(autouse=True, params=_admission_paths())
def engine(request: pytest.FixtureRequest, settings: Settings) -> None:
    """Both engines: the stored functions (PostgreSQL) and the ORM engine."""
    settings.POOLS = {**settings.POOLS, "SQL_FAST_PATH": request.param == "sql"}
    if not locking.combining():
        pytest.skip(f"{connection.vendor}: settles do not combine (locking.combining)")


class Holder:
    """Another transaction holding pools' row locks until :meth:`release`."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.holding = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            with locking.locked_pools(self.names):
                self.holding.set()
                self.done.wait(30)
        except BaseException as exc:  # reported by release()
            self.error = exc
            self.holding.set()
        finally:
            connections.close_all()

    def __enter__(self) -> Holder:
        self.thread.start()
        assert self.holding.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join(30)
        assert not self.thread.is_alive()
        assert self.error is None, self.error


@pytest.fixture
def busy_pool(recorder: RecordingBridge) -> Iterator[tuple[int, int]]:
    """Pool ``a`` (1 slot) held by ``first``; ``second`` waits behind it."""
    make_pool("a", 1)
    submit("a", key="first")
    submit("a", key="second")
    assert recorder.keys() == ["first"]
    first = recorder.admissions[0]
    yield first.entry_id, first.token


def test_settle__does_not_wait_for_a_held_pool_row_and_the_holder_admits(
    busy_pool: tuple[int, int], recorder: RecordingBridge
) -> None:
    entry_id, token = busy_pool
    with Holder(["a"]):
        # The pool row is locked: a waiting settle would block here for the whole hold
        # (and fail after LOCK_TIMEOUT_SECONDS); this one returns at once.
        assert admission.settle(entry_id, token, "succeeded")
        assert QueueEntry.objects.get(key="first").state == EntryState.SUCCEEDED
        assert Demand.objects.get(entry_id=entry_id).state == RELEASING
        assert recorder.keys() == ["first"]
    # The holder's transaction has ended: it found the owed release and admitted.
    assert recorder.keys() == ["first", "second"]
    assert QueueEntry.objects.get(key="second").state == EntryState.ADMITTED
    assert Demand.objects.get(entry_id=entry_id).state == EntryState.SUCCEEDED
    assert Pool.objects.get(name="a").held == 1


def test_settle__without_the_holders_recheck_a_wake_up_is_lost(
    busy_pool: tuple[int, int], recorder: RecordingBridge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sabotage twin: the holder does not re-check after its transaction ends."""
    monkeypatch.setattr(locking, "_released", [lambda names: None])
    entry_id, token = busy_pool
    with Holder(["a"]):
        assert admission.settle(entry_id, token, "succeeded")
    # Lost: 'second' waits although 'first' has finished and the slot is free.
    assert recorder.keys() == ["first"]
    assert QueueEntry.objects.get(key="second").state == EntryState.WAITING
    assert Demand.objects.get(entry_id=entry_id).state == RELEASING
    # The next holder of the pool's lock releases the owed slot (here: a pass).
    monkeypatch.undo()
    admission.admit(["a"])
    assert recorder.keys() == ["first", "second"]


def test_settle__a_free_pool_is_settled_at_once_under_its_lock(
    busy_pool: tuple[int, int], recorder: RecordingBridge
) -> None:
    entry_id, token = busy_pool
    assert admission.settle(entry_id, token, "succeeded")
    assert Demand.objects.get(entry_id=entry_id).state == EntryState.SUCCEEDED
    assert recorder.keys() == ["first", "second"]
    assert not Demand.objects.filter(state=RELEASING).exists()


def test_settle__multi_pool_entry_releases_the_free_pool_now_and_the_held_one_later(
    recorder: RecordingBridge,
) -> None:
    make_pool("a", 1)
    make_pool("b", 1)
    submit({"a": 1, "b": 1}, key="both")
    submit("a", key="in-a")
    submit("b", key="in-b")
    both = recorder.admissions[0]
    with Holder(["b"]):
        assert admission.settle(both.entry_id, both.token, "succeeded")
        # Pool a was free: released and admitted from at once; b is owed.
        assert recorder.keys() == ["both", "in-a"]
        states = dict(
            Demand.objects.filter(entry_id=both.entry_id).values_list("pool__name", "state")
        )
        assert states == {"a": EntryState.SUCCEEDED, "b": RELEASING}
    assert recorder.keys() == ["both", "in-a", "in-b"]
    assert set(Pool.objects.filter(name__in=["a", "b"]).values_list("name", "held")) == {
        ("a", 1),
        ("b", 1),
    }


def test_settle__twice_with_the_pool_held_settles_once(
    busy_pool: tuple[int, int], recorder: RecordingBridge
) -> None:
    entry_id, token = busy_pool
    with Holder(["a"]):
        assert admission.settle(entry_id, token, "succeeded")
        assert not admission.settle(entry_id, token, "failed")
    assert QueueEntry.objects.get(key="first").state == EntryState.SUCCEEDED
    assert Pool.objects.get(name="a").held == 1  # 'second' only: released once
