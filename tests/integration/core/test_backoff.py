"""Backoff (``raise pools.Backoff``): the entry waits again at its place, its pools pause
until a time and resume by themselves; on both engines (the PostgreSQL stored functions
skip a paused pool, and hand one whose backoff has ended to the Python pass, which resumes
it)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from pools.core import admission, backoffs, capacity, explain, pool_crud, settings_sync, sweeps
from pools.models import Pool, PoolEvent, QueueEntry
from pools.states import EntryState, EventKind
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = pytest.mark.django_db(transaction=True)


def claim(key: str) -> tuple[int, int]:
    entry = QueueEntry.objects.get(key=key)
    assert entry.state in (EntryState.ADMITTED, EntryState.RUNNING), entry.state
    return entry.queue_id, entry.token


def state(key: str) -> str:
    return QueueEntry.objects.get(key=key).state


def time_passes(name: str) -> None:
    """The backoff of pool ``name`` has ended (its end moved into the past: no sleeping)."""
    Pool.objects.filter(name=name).update(backoff_until=timezone.now() - timedelta(milliseconds=1))


def test_backoff__entry_waits_at_the_head_and_the_pool_admits_nothing_until_its_end(
    recorder: RecordingBridge, admission_path: str
) -> None:
    make_pool("p", 2)
    submit("p", key="a")
    submit("p", key="b")
    submit("p", key="c")  # waits: the pool is full
    done = backoffs.back_off(*claim("a"), 30, limit=5)
    assert done.requeued and done.backoffs == 1 and done.pools == ("p",)
    a = QueueEntry.objects.get(key="a")
    assert (a.state, a.reason, a.backoffs, a.lease_expires_at) == ("waiting", "backoff", 1, None)
    pool = Pool.objects.get(name="p")
    assert pool.paused and pool.backoff_until == done.until and pool.backoffs == 1
    assert pool.held == 1  # a's slot came back, b holds its own
    # Nothing is admitted while it backs off: not c (a slot is free), not a new call
    # (enqueue: the stored function on the sql path), not after b settles (settle function).
    assert not submit("p", key="d").admitted
    assert admission.settle(*claim("b"), EntryState.SUCCEEDED)
    assert admission.admit(["p"]) == []
    assert [state(k) for k in "acd"] == ["waiting"] * 3
    assert recorder.keys() == ["a", "b"]
    # The pass asked to be woken at the end.
    assert (["p"], done.until) in recorder.wakes
    # Its end comes: the wake-up's pass resumes the pool; a kept its place ahead of c and d.
    time_passes("p")
    assert [x.key for x in admission.wake(["p"])] == ["a", "c"]
    pool = Pool.objects.get(name="p")
    assert not pool.paused and pool.backoff_until is None
    kinds = list(PoolEvent.objects.filter(kind=EventKind.BACKOFF).values_list("pool", "entry_id"))
    assert kinds == [("p", a.queue_id), ("p", None)]  # the backoff, then its end


def test_backoff__after_its_end_a_settle_in_the_pool_resumes_it(
    recorder: RecordingBridge, admission_path: str
) -> None:
    """No wake-up came (lost with a broker outage, say): the next settle in the pool ends
    the backoff and admits, not the sweep a second later. On the sql path the settle
    function hands the pool to the Python pass (a 'fallback' pool)."""
    make_pool("p", 2)
    submit("p", key="a")
    submit("p", key="b")
    submit("p", key="c")
    backoffs.back_off(*claim("a"), 30, limit=5)
    time_passes("p")
    assert admission.settle(*claim("b"), EntryState.SUCCEEDED)
    assert [state(k) for k in "ac"] == [EntryState.ADMITTED] * 2
    pool = Pool.objects.get(name="p")
    assert not pool.paused and pool.backoff_until is None


def test_backoff__sabotage_without_the_pause_the_free_slot_is_used(
    recorder: RecordingBridge, admission_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The twin of the test above with the pause removed: its observation (nothing
    admitted while backing off) fails, so it is not vacuous."""
    monkeypatch.setattr(backoffs, "_pause", lambda pool, until, now: None)
    make_pool("p", 2)
    submit("p", key="a")
    submit("p", key="b")
    submit("p", key="c")
    assert backoffs.back_off(*claim("a"), 30, limit=5).requeued
    assert state("a") == EntryState.ADMITTED  # at the head, admitted again at once


def test_backoff__a_pool_with_reject_policy_queues_while_backing_off(
    recorder: RecordingBridge, admission_path: str
) -> None:
    make_pool("p", 1, paused_policy="reject")
    submit("p", key="a")
    backoffs.back_off(*claim("a"), 30, limit=5)
    got = submit("p", key="b")  # a pause asked by a task refuses nothing
    assert not got.admitted and state("b") == EntryState.WAITING


def test_backoff__explain_says_backoff_with_its_end(
    recorder: RecordingBridge, admission_path: str
) -> None:
    make_pool("p", 1)
    submit("p", key="a")
    done = backoffs.back_off(*claim("a"), 30, limit=5)
    assert done.until is not None
    got = explain.explain_key("a")
    assert got.blocked_by == "backoff"
    place = got.places[0]
    assert place.detail["until"] == done.until.isoformat()
    assert "backing off" in place.message and place.eta == done.until
    assert place.position == 1


def test_backoff__limit_reached_changes_nothing(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    submit("p", key="a")
    assert backoffs.back_off(*claim("a"), 1, limit=1).requeued
    time_passes("p")
    admission.admit(["p"])
    done = backoffs.back_off(*claim("a"), 1, limit=1)
    assert done.exceeded and not done.requeued and done.backoffs == 1
    assert state("a") == EntryState.ADMITTED
    assert not Pool.objects.get(name="p").paused


def test_backoff__stale_token_changes_nothing(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    submit("p", key="a")
    entry_id, token = claim("a")
    assert not backoffs.back_off(entry_id, token + 1, 5, limit=5).requeued
    assert state("a") == EntryState.ADMITTED and not Pool.objects.get(name="p").paused


def test_backoff__pauses_every_pool_of_the_entry_or_those_it_names(
    recorder: RecordingBridge, admission_path: str
) -> None:
    make_pool("api", 2)
    make_pool("db", 2)
    submit({"api": 1, "db": 1}, key="a")
    done = backoffs.back_off(*claim("a"), 30, limit=5)
    assert done.pools == ("api", "db")
    assert list(Pool.objects.filter(paused=True).values_list("name", flat=True)) == ["api", "db"]
    time_passes("api")
    time_passes("db")
    admission.admit(["api", "db"])
    done = backoffs.back_off(*claim("a"), 30, pools=["api", "elsewhere"], limit=5)
    assert done.pools == ("api",)
    assert list(Pool.objects.filter(paused=True).values_list("name", flat=True)) == ["api"]
    # db is not paused, but a keeps its place at the head of db's line too (no backfill):
    # a later call there waits behind it.
    assert not submit("db", key="b").admitted
    assert explain.explain_key("b").places[0].blocked_by == "head_of_line"
    assert explain.explain_key("a").blocked_by == "backoff"


def test_backoff__a_later_end_wins_and_a_pause_by_hand_outlasts_it(
    recorder: RecordingBridge,
) -> None:
    make_pool("p", 2)
    submit("p", key="a")
    submit("p", key="b")
    first = backoffs.back_off(*claim("a"), 60, limit=5)
    backoffs.back_off(*claim("b"), 1, limit=5)  # a shorter one does not shorten it
    assert Pool.objects.get(name="p").backoff_until == first.until
    assert Pool.objects.get(name="p").backoffs == 2
    # Paused by hand meanwhile: the backoff is over, the pause stays after its end.
    assert capacity.set_paused("p", True)
    pool = Pool.objects.get(name="p")
    assert pool.paused and pool.backoff_until is None
    assert admission.admit(["p"]) == []
    assert Pool.objects.get(name="p").paused


def test_backoff__resume_or_end_early_ends_it_now(
    recorder: RecordingBridge, admission_path: str
) -> None:
    make_pool("p", 1)
    submit("p", key="a")
    backoffs.back_off(*claim("a"), 60, limit=5)
    assert backoffs.end_early("p", actor="ops")
    assert not Pool.objects.get(name="p").paused and state("a") == EntryState.ADMITTED
    ended = PoolEvent.objects.filter(kind=EventKind.BACKOFF, entry_id=None).get()
    assert (ended.detail["ended"], ended.actor) == ("early", "ops")
    assert not backoffs.end_early("p")  # not backing off: nothing to do
    backoffs.back_off(*claim("a"), 60, limit=5)
    assert capacity.set_paused("p", False)
    pool = Pool.objects.get(name="p")
    assert not pool.paused and pool.backoff_until is None and state("a") == "admitted"
    # A pause by hand is not a backoff: end_early leaves it alone.
    capacity.set_paused("p", True)
    assert not backoffs.end_early("p") and Pool.objects.get(name="p").paused


def test_backoff__editing_other_fields_keeps_it_unpausing_ends_it(
    recorder: RecordingBridge,
) -> None:
    make_pool("p", 1)
    submit("p", key="a")
    backoffs.back_off(*claim("a"), 60, limit=5)
    pool_crud.update_pool("p", description="partner API", paused=True)
    assert Pool.objects.get(name="p").backoff_until is not None
    pool_crud.update_pool("p", paused=False)
    pool = Pool.objects.get(name="p")
    assert not pool.paused and pool.backoff_until is None


def test_backoff__survives_settings_sync_and_the_sweep_ends_it(
    recorder: RecordingBridge, settings: object
) -> None:
    settings.POOLS = {"DEFINITIONS": {"p": {"slots": 1}}}  # type: ignore[attr-defined]
    settings_sync.sync()
    submit("p", key="a")
    backoffs.back_off(*claim("a"), 60, limit=5)
    settings_sync.sync()  # a worker restart syncs settings: the backoff stays
    pool = Pool.objects.get(name="p")
    assert pool.paused and pool.backoff_until is not None
    sweeps.sweep()  # not over yet: nothing
    assert state("a") == EntryState.WAITING
    time_passes("p")
    sweeps.sweep()  # the wake-up was lost with the restart: the sweep ends it
    assert not Pool.objects.get(name="p").paused and state("a") == EntryState.ADMITTED
