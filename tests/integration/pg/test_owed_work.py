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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from django.db import connections
from django.utils import timezone

from pools.core import admission, admission_pass, dispatch, locking, pass_runs, sweeps
from pools.models import OwedWork, Pool, QueueEntry
from pools.pg import fastpath
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
def held_by_one_of_ours(
    names: str | list[str],
    then: Callable[[dict[str, Pool]], None] | None = None,
    *,
    raises: type[BaseException] | None = None,
) -> Iterator[None]:
    """Another thread holds pools ``names`` through :func:`locking.locked_pools` (as an ORM
    pass or the sweep does) until the block ends; then it runs ``then`` under the locks (a
    pass, a refusal that rolls back), commits or rolls back, and looks again. ``raises``:
    the error ``then`` must raise (the holder's own, not the test's)."""
    locked, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def hold() -> None:
        try:
            with locking.locked_pools([names] if isinstance(names, str) else names) as pools:
                locked.set()
                assert release.wait(30), "the test did not end its block"
                if then is not None:
                    then(pools)
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
    assert not thread.is_alive()
    expected = [type(e) for e in errors] == ([raises] if raises else [])
    assert expected, errors


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


#: A holder that rolls back looks again after the rollback, and its sabotage twin (not).
ROLLBACK_LOOKS = pytest.mark.parametrize(
    "look_after_rollback", [True, False], ids=["look", "sabotage-no-look-after-rollback"]
)


@ROLLBACK_LOOKS
def test_owed_work__a_holder_that_rolls_back_still_looks_again(
    recorder: RecordingBridge, monkeypatch: pytest.MonkeyPatch, look_after_rollback: bool
) -> None:
    """A holder whose transaction rolls back (a refusal raised under the locks, as
    ``cancel`` raises ``NotCancellable``; an error) loses its look after commit with the
    transaction; the settle that found the pool locked looked only while it was held. The
    holder looks after its rollback instead: the release is taken and the next entry
    admitted with no further call on the pool."""
    if not look_after_rollback:
        monkeypatch.setattr(locking, "_look_after_rollback", lambda names: None)
    make_pool("p", 1)
    submit("p", key="run")
    submit("p", key="next")
    run = recorder.admissions[0]

    def fail(pools: dict[str, Pool]) -> None:
        raise LookupError("refused under the lock")

    with held_by_one_of_ours("p", fail, raises=LookupError):
        assert admission.settle(run.entry_id, run.token, "succeeded") is True
        assert owed() == (1, True)
    admitted = QueueEntry.objects.get(key="next").state == EntryState.ADMITTED
    assert admitted is look_after_rollback
    assert owed()[1] is not look_after_rollback
    assert (recorder.keys() == ["run", "next"]) is look_after_rollback
    assert sweeps.check_held() == 0


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


#: The Python pass takes owed work itself, and its sabotage twin (it does not).
TAKES = pytest.mark.parametrize("takes_owed", [True, False], ids=["takes", "sabotage-no-take"])


@TAKES
def test_owed_work__a_python_pass_takes_an_owed_release_and_admits_a_multi_pool_head(
    recorder: RecordingBridge, monkeypatch: pytest.MonkeyPatch, takes_owed: bool
) -> None:
    """A Python pass (``admit_locked`` under ``locked_pools``, as a fallback pass or the
    sweep runs it) over a multi-pool set, while a settle of a one-pool entry finds one of
    those pools locked and leaves its release owed: the pass takes the release first and
    admits the multi-pool head waiting for those slots in the same pass. Without that
    (the twin) the head waits for the chain after the commit: the holder's look again
    takes the release in SQL, which hands the multi-pool head back to a Python pass."""
    if not takes_owed:
        monkeypatch.setattr(admission_pass, "apply_owed", lambda pools: None)
    make_pool("a", 1)
    make_pool("c", 2)
    submit("c", 2, key="run")
    assert not submit({"a": 1, "c": 2}, key="multi").admitted
    run = recorder.admissions[0]
    passes: list[admission_pass.PassResult] = []

    def python_pass(pools: dict[str, Pool]) -> None:
        step = admission_pass.admit_locked(pools, timezone.now())
        passes.append(step)
        dispatch.after_commit(
            step.admissions, step.finished, step.wake, requeue=pass_runs.requeue_unpublished
        )

    with held_by_one_of_ours(["a", "c"], python_pass):
        settled_, seconds = timed(lambda: admission.settle(run.entry_id, run.token, "succeeded"))
        assert settled_ is True
        assert seconds < 2, f"the settle waited {seconds:.2f}s for the lock"
        assert sum(OwedWork.objects.filter(pending=True).values_list("slots", flat=True)) == 2
    in_the_pass = [a.key for a in passes[0].admissions]
    assert in_the_pass == (["multi"] if takes_owed else [])
    # Either way it is admitted in the end (without the take: by the chain after the
    # commit), the release is taken once and the counters agree with the holders.
    assert QueueEntry.objects.get(key="multi").state == EntryState.ADMITTED
    assert recorder.keys() == ["run", "multi"]
    assert not OwedWork.objects.filter(pending=True).exists()
    assert dict(Pool.objects.filter(name__in=["a", "c"]).values_list("name", "held")) == {
        "a": 1,
        "c": 2,
    }
    assert sweeps.check_held() == 0


#: A wake-up leaves its pass to the lock holder; its twins: the holder does not look again,
#: the wake-up does not leave the pass (it only looks). (A wake-up that queues for the lock,
#: as before, fails the bound on its time: it waits until the holder's session is ended
#: after LOCK_TIMEOUT_SECONDS idle, then admits itself.)
WAKES = pytest.mark.parametrize(
    "sabotage", [None, "no-look", "no-owe"], ids=["owed", "sabotage-no-look", "sabotage-no-owe"]
)


@WAKES
def test_owed_work__a_wake_up_leaves_its_pass_to_the_lock_holder(
    recorder: RecordingBridge, monkeypatch: pytest.MonkeyPatch, sabotage: str | None
) -> None:
    """Timed wake-ups (``pools.admit``) come together, one from each process that saw a
    head due at that time: as passes they would queue on the pool's lock one behind the
    other. A wake-up that finds the pool locked commits an owed pass and returns without
    waiting; the holder runs that pass after its commit, and admits the head that came due."""
    no_look(monkeypatch, sabotage != "no-look")
    if sabotage == "no-owe":
        monkeypatch.setattr(fastpath, "owe_pass", lambda names, what: None)
    make_pool("p", 1)
    due = timezone.now() + timedelta(seconds=0.3)
    assert not submit("p", key="later", not_before=due).admitted
    time.sleep(0.4)  # due now; no pass has run since
    assert QueueEntry.objects.get(key="later").state == EntryState.WAITING
    with held_by_one_of_ours("p"):
        admitted, seconds = timed(lambda: admission.wake(["p"]))
        assert seconds < 2, f"the wake-up waited {seconds:.2f}s for the lock"
        assert admitted == []
        assert QueueEntry.objects.get(key="later").state == EntryState.WAITING
    admitted_after = QueueEntry.objects.get(key="later").state == EntryState.ADMITTED
    assert admitted_after is (sabotage is None)
    assert (recorder.keys() == ["later"]) is (sabotage is None)
    if sabotage is None:
        assert owed() == (0, False)
        assert sweeps.check_held() == 0
