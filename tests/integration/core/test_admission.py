"""Admission semantics on a real database (SQLite, and PostgreSQL in the postgres run)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.utils import timezone

from pools.core import admission
from pools.exceptions import (
    DemandExceedsCapacity,
    EntryNotFound,
    NotCancellable,
    PoolFull,
    UnknownPool,
)
from pools.models import Demand, Pool, QueueEntry
from pools.states import EntryState
from tests.conftest import POOL_APPS
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = [
    pytest.mark.django_db(transaction=True, available_apps=POOL_APPS),
    pytest.mark.usefixtures("admission_path"),  # both paths on PostgreSQL
]


def finish(rec: RecordingBridge, key: str, outcome: str = "succeeded") -> bool:
    adm = next(a for a in rec.admissions if a.key == key)
    return admission.settle(adm.entry_id, adm.token, outcome)


def held(pool: str) -> int:
    return sum(d.slots for d in Demand.objects.held().filter(pool__name=pool))


def test_enqueue__fast_path_admits_when_free(recorder: RecordingBridge) -> None:
    make_pool("p", 2)
    assert submit(key="a").admitted
    assert submit(key="b").admitted
    assert not submit(key="c").admitted
    assert recorder.keys() == ["a", "b"]
    assert held("p") == 2
    assert QueueEntry.objects.get(key="c").state == EntryState.WAITING


def test_settle__admits_next_in_priority_then_fifo_order(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    submit(key="run")
    submit(key="low", priority=0)
    submit(key="high", priority=5)
    submit(key="low2", priority=0)
    submit(key="high2", priority=5)
    order = ["run"]
    for _ in range(4):
        assert finish(recorder, order[-1])
        order.append(recorder.keys()[-1])
    assert order == ["run", "high", "high2", "low", "low2"]


def test_head_of_line__big_head_blocks_smaller_entries_behind_it(recorder: RecordingBridge) -> None:
    make_pool("p", 3)
    submit(key="one", slots=1)
    submit(key="two", slots=2)
    submit(key="big", slots=3)  # head: needs all 3
    submit(key="small", slots=1)  # would fit, but must not pass the head
    assert recorder.keys() == ["one", "two"]
    finish(recorder, "one")
    assert recorder.keys() == ["one", "two"], "one free slot must not be backfilled"
    finish(recorder, "two")
    assert recorder.keys()[-1] == "big"
    finish(recorder, "big")
    assert recorder.keys()[-1] == "small"


def test_multi_pool__acquires_all_or_nothing(recorder: RecordingBridge) -> None:
    make_pool("a", 1)
    make_pool("b", 1)
    submit("a", key="hold-a")
    submit({"a": 1, "b": 1}, key="both")
    assert recorder.keys() == ["hold-a"]
    assert held("b") == 0, "a multi-pool entry never holds some pools while waiting for others"
    submit("b", key="only-b")
    # 'both' is not b's head... it is: it was enqueued first; only-b waits behind it.
    assert recorder.keys() == ["hold-a"]
    finish(recorder, "hold-a")
    assert recorder.keys() == ["hold-a", "both"]
    assert held("a") == 1 and held("b") == 1
    finish(recorder, "both")
    assert recorder.keys()[-1] == "only-b"


def test_multi_pool__separate_pools_progress_independently(recorder: RecordingBridge) -> None:
    make_pool("a", 1)
    make_pool("b", 1)
    submit("a", key="a1")
    submit("a", key="a2")
    submit("b", key="b1")
    assert recorder.keys() == ["a1", "b1"]


def test_not_before__future_entry_is_out_of_line_and_blocks_nothing(
    recorder: RecordingBridge,
) -> None:
    make_pool("p", 1)
    submit(key="eta", not_before=timezone.now() + timedelta(hours=1), priority=9)
    assert submit(key="now").admitted, "an entry not yet due blocks nothing behind it"
    assert recorder.wakes == [], "an entry an hour away is left to the sweep"
    assert Demand.objects.get(entry__key="eta").state == "delayed"
    assert QueueEntry.objects.get(key="eta").state == EntryState.WAITING


def test_not_before__due_entry_joins_line_as_if_sent_then(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    submit(key="run")
    submit(key="early")
    due = timezone.now() + timedelta(seconds=0.3)
    submit(key="eta", not_before=due)
    assert recorder.wakes == [(["p"], due)], "a timed wake-up for when it is due"
    time.sleep(0.4)
    submit(key="late")
    order = ["run"]
    for _ in range(3):
        assert finish(recorder, order[-1])
        order.append(recorder.keys()[-1])
    assert order == ["run", "early", "eta", "late"]


def test_not_before__due_entry_goes_by_priority_first(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    submit(key="run")
    submit(key="low1")
    submit(key="low2")
    submit(key="urgent", priority=5, not_before=timezone.now() + timedelta(seconds=0.2))
    time.sleep(0.3)
    assert finish(recorder, "run")
    assert recorder.keys()[-1] == "urgent"


def test_not_before__wake_up_admits_a_due_entry_into_a_free_pool(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    submit(key="eta", not_before=timezone.now() + timedelta(seconds=0.2))
    assert recorder.keys() == []
    time.sleep(0.3)
    admission.admit(["p"])  # what the wake-up task runs
    assert recorder.keys() == ["eta"]


def test_not_before__multi_pool_entry_joins_all_its_lines_at_once(
    recorder: RecordingBridge,
) -> None:
    make_pool("a", 1)
    make_pool("b", 1)
    submit({"a": 1, "b": 1}, key="both", not_before=timezone.now() + timedelta(seconds=0.2))
    time.sleep(0.3)
    admission.admit(["a"])  # a pass over one of its pools follows up with the other
    assert recorder.keys() == ["both"]
    assert set(Demand.objects.filter(entry__key="both").values_list("state", flat=True)) == {
        "admitted"
    }


def test_max_queued__counts_delayed_entries(recorder: RecordingBridge) -> None:
    make_pool("p", 1, max_queued=1)
    submit(key="run")
    submit(key="later", not_before=timezone.now() + timedelta(hours=1))
    with pytest.raises(PoolFull):
        submit(key="more")


def test_expires__passing_while_waiting_ends_the_entry_as_expired(
    recorder: RecordingBridge,
) -> None:
    make_pool("p", 1)
    submit(key="run")
    gone = timezone.now() + timedelta(seconds=0.2)
    submit(key="short", expires=gone, options={"expires": gone.isoformat()})
    submit(key="patient", queue_timeout=0.2)
    time.sleep(0.3)
    assert finish(recorder, "run")
    reasons = {f.key: f.reason for f in recorder.finished}
    assert reasons == {"short": "expired", "patient": "queue_timeout"}
    assert recorder.keys() == ["run"]


def test_max_queued__refuses_with_message_and_keeps_queue(recorder: RecordingBridge) -> None:
    make_pool("p", 1, max_queued=2)
    submit(key="running")
    submit(key="w1")
    submit(key="w2")
    with pytest.raises(PoolFull, match=r"Pool 'p' is full.*max_queued=2"):
        submit(key="w3")
    assert not QueueEntry.objects.filter(key="w3").exists()
    assert QueueEntry.objects.waiting().count() == 2


def test_enqueue__unknown_pool_and_oversized_demand_are_refused(recorder: RecordingBridge) -> None:
    make_pool("p", 2)
    with pytest.raises(UnknownPool, match="'nope' does not exist"):
        submit("nope")
    with pytest.raises(DemandExceedsCapacity, match="3 slot"):
        submit("p", slots=3)
    assert QueueEntry.objects.count() == 0


def test_settle__is_exactly_once_per_token(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    submit(key="a")
    adm = recorder.admissions[0]
    assert admission.settle(adm.entry_id, adm.token, "succeeded")
    assert not admission.settle(adm.entry_id, adm.token, "succeeded")
    assert not admission.settle(adm.entry_id, adm.token + 1, "failed")
    entry = QueueEntry.objects.get(pk=adm.entry_id)
    assert (entry.state, entry.token) == (EntryState.SUCCEEDED, adm.token)
    assert Pool.objects.get(name="p").held == 0, "the slot was released once"


def test_paused_pool__admits_nothing_until_resumed(recorder: RecordingBridge) -> None:
    pool = make_pool("p", 2, paused=True)
    submit(key="a")
    assert recorder.keys() == []
    pool.paused = False
    pool.save()
    admission.admit(["p"])
    assert recorder.keys() == ["a"]


def test_cancel__waiting_entry_is_cancelled_and_reported(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    submit(key="run")
    submit(key="wait")
    entry = admission.cancel("wait")
    assert entry.state == EntryState.CANCELLED
    assert [f.key for f in recorder.finished] == ["wait"]
    with pytest.raises(NotCancellable, match="already running"):
        admission.cancel("run")
    with pytest.raises(EntryNotFound):
        admission.cancel("missing")


def test_deadline__expired_head_leaves_the_line(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    submit(key="run")
    submit(key="late", queue_timeout=0.001)
    submit(key="next")
    QueueEntry.objects.filter(key="late").update(deadline=timezone.now() - timedelta(seconds=1))
    finish(recorder, "run")
    assert recorder.keys() == ["run", "next"]
    assert QueueEntry.objects.get(key="late").state == EntryState.EXPIRED
    assert [f.state for f in recorder.finished] == ["expired"]


def test_requeue__keeps_place_in_line(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    submit(key="first", priority=1)
    submit(key="second", priority=1)
    adm = recorder.admissions[0]
    entry = QueueEntry.objects.get(key="first")
    # Publishing failed: it goes back in line ahead of 'second' and is admitted again.
    assert admission.requeue(adm.entry_id, adm.token, reason="publish failed")
    assert recorder.keys() == ["first", "first"]
    again = QueueEntry.objects.get(pk=entry.pk)
    assert again.token == adm.token + 1
    assert again.enqueued_at == entry.enqueued_at


def test_not_before__near_head_schedules_a_timed_admission(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    soon = timezone.now() + timedelta(seconds=2)
    submit(key="eta", not_before=soon)
    assert recorder.wakes == [(["p"], soon)]
