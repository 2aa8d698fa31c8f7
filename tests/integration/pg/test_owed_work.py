"""Contention on the PostgreSQL engine: a call that finds its pool locked leaves its work to
the lock holder (docs/concepts/admission.md#contention-the-lock-holder-admits-for-everyone).

A settle of a one-pool entry ends its entry at once and leaves its release owed; an
enqueue puts its entry in line with an owed admission pass; the holder (here one of ours:
``locked_pools``, as the ORM engine's passes and the sweep hold pools) takes that work
after its commit. Each test has a twin without that look after the commit (the hook
removed), which must leave the work undone: the proof that the look is what does it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import connections

from pools.core import admission, locking, sweeps
from pools.models import OwedWork, Pool, QueueEntry
from pools.states import EntryState
from tests.conftest import POOL_APPS
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True, available_apps=POOL_APPS),
]

#: With the look after the commit, and its sabotage twin without it.
LOOKS = pytest.mark.parametrize("look_again", [True, False], ids=["look", "sabotage-no-look"])


@contextmanager
def held_by_one_of_ours(name: str) -> Iterator[None]:
    """Another thread holds pool ``name`` through :func:`locking.locked_pools` (as an ORM
    pass or the sweep does) until the block ends; then it commits, and looks again."""
    locked, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def hold() -> None:
        try:
            with locking.locked_pools([name]):
                locked.set()
                release.wait(30)
        except BaseException as exc:  # reported by the test
            errors.append(exc)
        finally:
            locked.set()
            connections.close_all()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert locked.wait(10), "the holder did not get the lock"
    try:
        yield
    finally:
        release.set()
        thread.join(30)
    assert not thread.is_alive() and not errors, errors


def no_look(monkeypatch: pytest.MonkeyPatch, look_again: bool) -> None:
    """The sabotage: lock holders do not look again after their commit."""
    if not look_again:
        monkeypatch.setattr(locking, "_after_locks", [])


def timed(call: Any) -> tuple[Any, float]:
    began = time.perf_counter()
    return call(), time.perf_counter() - began


def owed() -> tuple[int, bool]:
    """Slots owed to the holder of pool p's lock, and whether any work is owed at all."""
    rows = OwedWork.objects.filter(pool__name="p", pending=True)
    return sum(rows.values_list("slots", flat=True)), rows.exists()


@LOOKS
def test_owed_work__a_settle_leaves_its_release_to_the_lock_holder(
    recorder: RecordingBridge, monkeypatch: pytest.MonkeyPatch, look_again: bool
) -> None:
    no_look(monkeypatch, look_again)
    make_pool("p", 1)
    submit("p", key="run")
    submit("p", key="next")
    run = recorder.admissions[0]
    with held_by_one_of_ours("p"):
        settled, seconds = timed(lambda: admission.settle(run.entry_id, run.token, "succeeded"))
        assert settled is True
        assert seconds < 2, f"the settle waited {seconds:.2f}s for the lock"
        assert QueueEntry.objects.get(key="run").state == EntryState.SUCCEEDED
        assert owed() == (1, True)
        assert Pool.objects.get(name="p").held == 1, "released before the holder took it"
        assert sweeps.check_held() == 0, "the sweep 'corrected' a counter with a release owed"
        assert QueueEntry.objects.get(key="next").state == EntryState.WAITING
    admitted = QueueEntry.objects.get(key="next").state == EntryState.ADMITTED
    assert admitted is look_again
    if look_again:
        assert recorder.keys() == ["run", "next"]
        assert owed() == (0, False)
        assert Pool.objects.get(name="p").held == 1


@LOOKS
def test_owed_work__an_enqueue_puts_its_entry_in_line_for_the_lock_holder(
    recorder: RecordingBridge, monkeypatch: pytest.MonkeyPatch, look_again: bool
) -> None:
    no_look(monkeypatch, look_again)
    make_pool("p", 2)
    with held_by_one_of_ours("p"):
        enqueued, seconds = timed(lambda: submit("p", key="a"))
        assert seconds < 2, f"the enqueue waited {seconds:.2f}s for the lock"
        assert not enqueued.admitted
        assert QueueEntry.objects.get(key="a").state == EntryState.WAITING
        assert owed() == (0, True)
    assert (QueueEntry.objects.get(key="a").state == EntryState.ADMITTED) is look_again
    assert (recorder.keys() == ["a"]) is look_again


def test_owed_work__the_next_call_takes_what_a_foreign_holder_left(
    recorder: RecordingBridge,
) -> None:
    """A holder that does not look again (a session of another program, or a process of
    the previous release during a deploy): the work waits for the next call on the pool,
    which takes it all."""
    import psycopg

    make_pool("p", 2)
    submit("p", key="run")
    run = recorder.admissions[0]
    params = connections["default"].get_connection_params()
    foreign = psycopg.connect(
        **{k: v for k, v in params.items() if k not in {"cursor_factory", "context"}}
    )
    try:
        foreign.execute("SELECT 1 FROM pools_pool WHERE name = 'p' FOR NO KEY UPDATE")
        assert admission.settle(run.entry_id, run.token, "succeeded")
        assert not submit("p", key="b").admitted
    finally:
        foreign.rollback()
        foreign.close()
    assert owed() == (1, True)  # the release and the pass, in one row or two
    assert QueueEntry.objects.get(key="b").state == EntryState.WAITING
    assert submit("p", key="c").admitted  # the next call: the release, then b and c
    assert recorder.keys() == ["run", "b", "c"]
    assert owed() == (0, False)
    assert Pool.objects.get(name="p").held == 2
