"""Pool policies in admission (issue 13): forbid, node affinity heads, capacity drain,
pause, overflow, retire. On SQLite (ORM path) and, in the postgres run, on both paths."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.test import override_settings
from django.utils import timezone

from pools.core import (
    admission,
    capacity,
    explain,
    leases,
    nodes,
    pool_crud,
    settings_sync,
    snapshots,
    sweeps,
)
from pools.exceptions import PoolDraining, PoolFull, PoolPaused
from pools.models import Pool, PoolEvent, QueueEntry, WorkerNode
from pools.states import EntryState, EventKind
from tests.conftest import POOL_APPS
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = [
    pytest.mark.django_db(transaction=True, available_apps=POOL_APPS),
    pytest.mark.usefixtures("admission_path"),  # both paths on PostgreSQL
]


def defined(pools: dict[str, dict[str, int]]) -> override_settings:
    """POOLS['DEFINITIONS'] replaced (the recorder's publisher kept)."""
    return override_settings(POOLS={**settings.POOLS, "DEFINITIONS": pools})


def finish(rec: RecordingBridge, key: str, outcome: str = "succeeded") -> bool:
    adm = [a for a in rec.admissions if a.key == key][-1]
    return admission.settle(adm.entry_id, adm.token, outcome)


def state(key: str) -> str:
    return QueueEntry.objects.get(key=key).state


def forbid(key: str, job: str = "nightly", pools: str | dict[str, int] = "p") -> bool:
    return submit(pools, key=key, job=job, concurrency_policy="forbid").admitted


# --------------------------------------------------------------------------- forbid


def test_forbid__waits_while_its_job_runs_and_blocks_lower_entries(
    recorder: RecordingBridge,
) -> None:
    make_pool("p", 3)
    assert forbid("first")
    assert not forbid("second")  # same job: waits although two slots are free
    assert not submit("p", key="plain").admitted  # behind an ineligible head: blocked
    assert recorder.keys() == ["first"]
    why = explain.explain_key("second")
    assert why.blocked_by == "forbid"
    assert why.places[0].detail["holder"]["key"] == "first"
    behind = explain.explain_key("plain")
    assert behind.blocked_by == "head_of_line"
    assert behind.places[0].detail["ahead"]["blocked_by"] == "forbid"
    assert finish(recorder, "first")  # the settle's pass admits both now
    assert recorder.keys() == ["first", "second", "plain"]


def test_forbid__other_jobs_and_allow_entries_are_not_held_back(
    recorder: RecordingBridge,
) -> None:
    make_pool("p", 3)
    assert forbid("a", job="nightly")
    assert forbid("b", job="hourly")
    # 'allow' (the default) ignores other instances even with a job.
    assert submit("p", key="c", job="nightly").admitted
    assert recorder.keys() == ["a", "b", "c"]


def test_forbid__two_waiting_instances_are_admitted_one_at_a_time(
    recorder: RecordingBridge,
) -> None:
    make_pool("p", 1)
    assert submit("p", key="blocker").admitted
    forbid("one")
    forbid("two")
    assert finish(recorder, "blocker")  # one pass: 'one' is admitted, 'two' then waits
    assert recorder.keys() == ["blocker", "one"]
    make_pool("p", 5)
    admission.admit(["p"])
    assert state("two") == EntryState.WAITING
    assert finish(recorder, "one")
    assert recorder.keys() == ["blocker", "one", "two"]


def test_forbid__an_instance_finishing_in_another_pool_lets_the_waiter_in(
    recorder: RecordingBridge,
) -> None:
    make_pool("a", 1)
    make_pool("b", 1)
    assert forbid("in-a", pools="a")
    assert not forbid("in-b", pools="b")
    assert finish(recorder, "in-a")  # settles in pool a; the follow-up pass covers b
    assert state("in-b") == EntryState.ADMITTED


# --------------------------------------------------------------------------- node affinity


def test_pinned__waits_for_its_worker_blocking_its_pool_then_runs(
    recorder: RecordingBridge,
) -> None:
    make_pool("p", 2)
    assert not submit("p", key="pinned", pinned_worker="w1@host").admitted
    assert not submit("p", key="later").admitted
    assert explain.explain_key("pinned").blocked_by == "worker_unavailable"
    nodes.beat("w1@host")
    admission.admit(["p"])
    assert recorder.keys() == ["pinned", "later"]


def test_pinned__a_stale_heartbeat_is_no_worker_and_the_deadline_still_ends_it(
    recorder: RecordingBridge,
) -> None:
    make_pool("p", 1)
    nodes.beat("w1@host")
    WorkerNode.objects.filter(hostname="w1@host").update(
        last_seen=timezone.now() - timedelta(hours=1)
    )
    assert not submit("p", key="pinned", pinned_worker="w1@host", queue_timeout=60).admitted
    QueueEntry.objects.filter(key="pinned").update(deadline=timezone.now() - timedelta(seconds=1))
    admission.admit(["p"])
    assert state("pinned") == EntryState.EXPIRED


# --------------------------------------------------------------------------- capacity drain


def capacity_events(pool: str) -> list[dict[str, object]]:
    return [
        e.detail
        for e in PoolEvent.objects.filter(kind=EventKind.CAPACITY_CHANGED, pool=pool).order_by("pk")
    ]


def test_drain__decrease_keeps_the_old_capacity_until_the_line_is_empty(
    recorder: RecordingBridge,
) -> None:
    make_pool("p", 2)
    for key in ("r1", "r2", "w1", "w2"):
        submit("p", key=key)
    pool_crud.update_pool("p", slots=1)
    pool = Pool.objects.get(name="p")
    assert (pool.slots, pool.pending_slots) == (2, 1)
    snap = snapshots.snapshot("p")
    assert (snap.slots, snap.capacity, snap.draining) == (1, 2, True)
    with pytest.raises(PoolDraining, match=r"draining to 1 slot.*2 entries"):
        submit("p", key="refused")
    assert not QueueEntry.objects.filter(key="refused").exists()
    assert finish(recorder, "r1")  # old capacity: w1 takes the freed slot
    assert state("w1") == EntryState.ADMITTED
    assert Pool.objects.get(name="p").pending_slots == 1
    assert finish(recorder, "r2")  # w2 admitted: the line is empty, 1 slot from now
    assert state("w2") == EntryState.ADMITTED
    pool = Pool.objects.get(name="p")
    assert (pool.slots, pool.pending_slots) == (1, None)
    assert capacity_events("p")[-1] == {"from": 2, "to": 1, "drained": True}
    assert QueueEntry.objects.get(key="w2").attempt == 0
    assert not submit("p", key="after").admitted  # 2 held of 1: waits
    assert finish(recorder, "w1")
    assert state("after") == EntryState.WAITING  # still 1 held of 1
    assert finish(recorder, "w2")
    assert state("after") == EntryState.ADMITTED


def test_drain__increase_with_entries_in_flight_waits_for_the_old_queue(
    recorder: RecordingBridge,
) -> None:
    make_pool("p", 1)
    for key in ("r1", "w1", "w2"):
        submit("p", key=key)
    pool_crud.update_pool("p", slots=3)
    assert snapshots.snapshot("p").capacity == 1
    assert finish(recorder, "r1")
    assert recorder.keys() == ["r1", "w1"]  # one at a time: the old capacity
    assert finish(recorder, "w1")
    assert recorder.keys() == ["r1", "w1", "w2"]
    assert Pool.objects.get(name="p").slots == 3
    assert submit("p", key="n1").admitted and submit("p", key="n2").admitted
    assert not submit("p", key="n3").admitted


def test_drain__no_waiting_entry_takes_effect_at_once_and_cancel_ends_a_drain(
    recorder: RecordingBridge,
) -> None:
    make_pool("p", 1)
    submit("p", key="run")
    pool_crud.update_pool("p", slots=2)  # nothing waits: now
    assert Pool.objects.get(name="p").slots == 2
    submit("p", key="r2")
    submit("p", key="w")
    pool_crud.update_pool("p", slots=4)
    assert Pool.objects.get(name="p").pending_slots == 4
    admission.cancel("w")  # the line empties in the cancel's transaction
    pool = Pool.objects.get(name="p")
    assert (pool.slots, pool.pending_slots) == (4, None)


def test_drain__settings_sync_drains_and_reports(recorder: RecordingBridge) -> None:
    with defined({"p": {"slots": 1}}):
        settings_sync.sync()
        submit("p", key="run")
        submit("p", key="w")
    with defined({"p": {"slots": 5}}):
        report = settings_sync.sync()
        assert report.draining == ["p"]
        progress = capacity.drain_progress("p")
        assert (progress.capacity, progress.slots, progress.left) == (1, 5, 1)
        assert settings_sync.sync().unchanged == ["p"]  # the pending capacity is the configured one


# --------------------------------------------------------------------------- pause


def test_pause__queue_policy_keeps_entries_in_place_until_resumed(
    recorder: RecordingBridge,
) -> None:
    make_pool("p", 2)
    capacity.set_paused("p", True)
    assert not submit("p", key="a").admitted
    assert not submit("p", key="b").admitted
    capacity.set_paused("p", False)
    assert recorder.keys() == ["a", "b"]


def test_pause__reject_policy_refuses_new_submits(recorder: RecordingBridge) -> None:
    make_pool("p", 2, paused_policy="reject")
    capacity.set_paused("p", True)
    with pytest.raises(PoolPaused, match="paused and refuses new entries"):
        submit("p", key="a")
    assert not QueueEntry.objects.exists()
    capacity.set_paused("p", False)
    assert submit("p", key="b").admitted


# --------------------------------------------------------------------------- overflow


@pytest.mark.parametrize(
    "policy,dropped", [("drop_oldest", "w1"), ("drop_newest", "w2")], ids=["oldest", "newest"]
)
def test_overflow__drop_policy_rejects_one_waiting_entry(
    recorder: RecordingBridge, policy: str, dropped: str
) -> None:
    make_pool("p", 1, max_queued=2, overflow=policy)
    submit("p", key="run")
    submit("p", key="w1")
    submit("p", key="w2")
    assert not submit("p", key="new").admitted
    entry = QueueEntry.objects.get(key=dropped)
    assert entry.state == EntryState.REJECTED
    assert f"overflow policy {policy}" in entry.reason
    assert PoolEvent.objects.filter(kind=EventKind.REJECTED, key=dropped).exists()
    [gone] = recorder.finished
    assert (gone.key, gone.dropped_at, gone.pool) == (dropped, 2, "p")
    assert QueueEntry.objects.waiting().count() == 2


def test_overflow__reject_is_the_default(recorder: RecordingBridge) -> None:
    make_pool("p", 1, max_queued=1)
    submit("p", key="run")
    submit("p", key="w1")
    with pytest.raises(PoolFull):
        submit("p", key="new")


# --------------------------------------------------------------------------- retire


def test_retire__a_pool_removed_from_settings_is_deleted_once_empty(
    recorder: RecordingBridge,
) -> None:
    with defined({"old": {"slots": 1}, "idle": {"slots": 1}}):
        settings_sync.sync()
        submit("old", key="run")
        submit("old", key="w")
    with defined({}):
        report = settings_sync.sync()
        assert report.retiring == {"old": 2} and report.deleted == ["idle"]
        assert Pool.objects.get(name="old").retiring
        assert sweeps.sweep().retired == ()
        admission.cancel("w")
        assert finish(recorder, "run")
        assert sweeps.sweep().retired == ("old",)
        assert not Pool.objects.filter(name__in=["old", "idle"]).exists()


# --------------------------------------------------------------------------- manage.py pools


def test_command__drain_pause_resume_and_sync_report(
    recorder: RecordingBridge, capsys: pytest.CaptureFixture[str]
) -> None:
    make_pool("p", 1)
    submit("p", key="run")
    submit("p", key="w")
    call_command("pools", "drain", "p")
    assert "p: not draining; capacity 1, 1 held, 1 waiting" in capsys.readouterr().out
    pool_crud.update_pool("p", slots=2)
    call_command("pools", "drain", "p")
    out = capsys.readouterr().out
    assert "draining from 1 to 2 slot(s): 1 entry queued before the change left" in out
    call_command("pools", "list")
    assert "(draining to 2)" in capsys.readouterr().out
    call_command("pools", "pause", "p")
    assert Pool.objects.get(name="p").paused
    call_command("pools", "resume", "p")
    assert "resumed p" in capsys.readouterr().out.splitlines()[-1]
    with pytest.raises(CommandError, match="does not exist"):
        call_command("pools", "pause", "nope")
    with defined({"gone": {"slots": 1}}):
        settings_sync.sync()
        submit("gone", key="g")
    with defined({}):
        call_command("pools", "sync")
    assert "retiring: gone was removed from settings but has 1 unfinished entry" in (
        capsys.readouterr().out
    )


def test_pinned__only_its_worker_can_start_it(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    nodes.beat("w1@host")
    assert submit("p", key="pinned", pinned_worker="w1@host").admitted
    adm = recorder.admissions[-1]
    # A delivery to another worker is refused like a stale one: it does not run there.
    assert leases.start(adm.entry_id, adm.token, worker="w2@host") is None
    assert state("pinned") == EntryState.ADMITTED
    assert leases.start(adm.entry_id, adm.token, worker="w1@host") is not None
    assert state("pinned") == EntryState.RUNNING
