"""Leases: start/renew by fencing token, lapsed-lease recovery, deadlines, the keeper."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import connection
from django.utils import timezone
from pytest_django import Settings

from pools.celery.keeper import LeaseKeeper, body_running
from pools.core import admission, leases, sweeps
from pools.core.leases import Claim
from pools.exceptions import LeaseLost
from pools.models import PoolEvent, QueueEntry
from pools.states import EntryState, EventKind
from tests.conftest import POOL_APPS
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = [
    pytest.mark.django_db(transaction=True, available_apps=POOL_APPS),
    pytest.mark.usefixtures("admission_path"),  # both paths on PostgreSQL
]


def lapse(key: str) -> None:
    QueueEntry.objects.filter(key=key).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )


def test_start__compare_and_set_once_per_token(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    submit(key="a")
    adm = recorder.admissions[0]
    assert leases.start(adm.entry_id, adm.token, worker="w1") is not None
    assert leases.start(adm.entry_id, adm.token, worker="w2") is None, "duplicate delivery"
    assert leases.start(adm.entry_id, adm.token - 1, worker="w3") is None, "stale token"
    assert QueueEntry.objects.get(key="a").worker == "w1"


def test_renew__refused_for_stale_token(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    submit(key="a")
    adm = recorder.admissions[0]
    assert leases.renew(adm.entry_id, adm.token) is not None
    assert leases.renew(adm.entry_id, adm.token + 1) is None


def test_renew_if_ending__writes_only_a_lease_near_its_end(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    submit(key="a")
    adm = recorder.admissions[0]
    assert leases.start(adm.entry_id, adm.token, worker="w1") is not None
    full = QueueEntry.objects.get(key="a").lease_expires_at
    assert full is not None
    left = (full - timezone.now()).total_seconds()
    assert leases.renew_if_ending(adm.entry_id, adm.token, within=left - 1) is None
    assert QueueEntry.objects.get(key="a").lease_expires_at == full, "a healthy lease was written"
    near = timezone.now() + timedelta(seconds=1)
    QueueEntry.objects.filter(key="a").update(lease_expires_at=near)
    assert leases.renew_if_ending(adm.entry_id, adm.token + 1, within=5) is None, "stale token"
    until = leases.renew_if_ending(adm.entry_id, adm.token, within=5)
    assert until is not None and until > near
    assert QueueEntry.objects.get(key="a").lease_expires_at == until


def test_sweep__lapsed_lease_returns_entry_to_its_place(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    submit(key="first", priority=5)
    submit(key="second", priority=1)
    first = recorder.admissions[0]
    leases.start(first.entry_id, first.token, worker="dead-worker")
    lapse("first")
    report = sweeps.sweep()
    assert report.requeued == 1
    # Back in line ahead of 'second' (same priority and enqueue time) and admitted again.
    assert recorder.keys() == ["first", "first"]
    again = QueueEntry.objects.get(key="first")
    assert again.state == EntryState.ADMITTED and again.token == first.token + 1
    # The dead worker's late completion carries the old token and is ignored.
    assert not admission.settle(first.entry_id, first.token, "succeeded")
    assert QueueEntry.objects.get(key="second").state == EntryState.WAITING


def test_sweep__schedules_a_reclaim_at_a_lease_end_before_the_next_sweep(
    recorder: RecordingBridge, settings: Settings
) -> None:
    settings.POOLS = {**settings.POOLS, "SWEEP_SECONDS": 5}
    make_pool("p", 1)
    make_pool("q", 1)
    submit("p", key="soon")
    submit("q", key="later")
    now = timezone.now()
    QueueEntry.objects.filter(key="soon").update(lease_expires_at=now + timedelta(seconds=2))
    QueueEntry.objects.filter(key="later").update(lease_expires_at=now + timedelta(seconds=20))
    sweeps.sweep(now)
    # One timed wake-up, for the pool of the lease that lapses (end + grace) before the
    # next sweep.
    when = now + timedelta(seconds=2) + sweeps.grace() + sweeps.LAPSE_MARGIN
    assert recorder.wakes == [(["p"], when)]


def test_sweep__a_lease_lapses_only_after_the_requeue_grace(
    recorder: RecordingBridge, settings: Settings
) -> None:
    """The holder fences by the lease end on its own clock; others wait out the grace."""
    settings.POOLS = {**settings.POOLS, "REQUEUE_GRACE_SECONDS": 3.0}
    make_pool("p", 1)
    submit("p", key="held")
    now = timezone.now()
    QueueEntry.objects.filter(key="held").update(lease_expires_at=now - timedelta(seconds=2))
    token = QueueEntry.objects.get(key="held").token
    assert sweeps.reclaim(now) == 0  # ended 2 s ago: within the grace
    assert QueueEntry.objects.get(key="held").token == token
    assert sweeps.reclaim(now + timedelta(seconds=1.01)) == 1  # back in line, admitted again
    assert QueueEntry.objects.get(key="held").token != token


def test_sweep__no_reclaim_wake_up_when_no_lease_ends_before_the_next_sweep(
    recorder: RecordingBridge, settings: Settings
) -> None:
    settings.POOLS = {**settings.POOLS, "SWEEP_SECONDS": 5}
    make_pool("p", 1)
    submit("p", key="later")
    sweeps.sweep()
    assert recorder.wakes == []


def test_admit_task__reclaims_lapsed_leases_before_admitting(recorder: RecordingBridge) -> None:
    from pools.celery.tasks import admit

    make_pool("p", 1)
    submit("p", key="dead")
    submit("p", key="next")
    dead = recorder.admissions[0]
    leases.start(dead.entry_id, dead.token, worker="gone")
    lapse("dead")
    admit(["p"])  # what the timed wake-up runs
    requeued = PoolEvent.objects.get(key="dead", kind=EventKind.REQUEUED)
    assert requeued.detail["reason"] == "lease lapsed"
    # Back at the head of the line and admitted again with a new token.
    assert recorder.keys() == ["dead", "dead"]
    assert QueueEntry.objects.get(key="dead").token == dead.token + 1


def test_sweep__lapsed_lease_past_deadline_expires(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    submit(key="a", queue_timeout=60)
    QueueEntry.objects.filter(key="a").update(deadline=timezone.now() - timedelta(seconds=1))
    lapse("a")
    sweeps.sweep()
    assert QueueEntry.objects.get(key="a").state == EntryState.EXPIRED
    assert [f.key for f in recorder.finished] == ["a"]


def test_sweep__expires_waiting_entries_past_deadline_anywhere_in_line(
    recorder: RecordingBridge,
) -> None:
    make_pool("p", 1)
    submit(key="holder")
    submit(key="w1")
    submit(key="w2", queue_timeout=60)
    QueueEntry.objects.filter(key="w2").update(deadline=timezone.now() - timedelta(seconds=1))
    assert sweeps.sweep().expired == 1
    assert QueueEntry.objects.get(key="w2").state == EntryState.EXPIRED
    assert QueueEntry.objects.get(key="w1").state == EntryState.WAITING


def test_settle_live_lease__refused_after_lapse(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    submit(key="a")
    adm = recorder.admissions[0]
    lapse("a")
    assert not admission.settle(adm.entry_id, adm.token, "succeeded", live_lease=True)
    assert admission.settle(adm.entry_id, adm.token, "succeeded")


def test_sweep__prunes_old_terminal_entries(recorder: RecordingBridge, settings: Settings) -> None:
    make_pool("p", 1)
    submit(key="a")
    adm = recorder.admissions[0]
    admission.settle(adm.entry_id, adm.token, "succeeded")
    QueueEntry.objects.filter(key="a").update(finished_at=timezone.now() - timedelta(days=30))
    assert sweeps.sweep().pruned == 1
    assert not QueueEntry.objects.filter(key="a").exists()


def test_sweep_is_registered_with_celery_beat() -> None:
    from django_celery_beat.models import PeriodicTask

    task = PeriodicTask.objects.get(name="pools: sweep")
    assert task.task == "pools.sweep" and task.enabled
    assert task.interval.every == 5


def test_sweep_command__prints_report(
    recorder: RecordingBridge, capsys: pytest.CaptureFixture[str]
) -> None:
    make_pool("p", 1)
    call_command("pools", "sweep")
    assert "requeued 0, expired 0" in capsys.readouterr().out


def start(entry_id: int, token: int) -> Claim:
    """``leases.start`` on worker ``w``, which must succeed (the entry was just admitted)."""
    claim = leases.start(entry_id, token, worker="w")
    assert claim is not None
    return claim


@pytest.fixture
def short_lease(settings: Settings) -> None:
    settings.POOLS = {**settings.POOLS, "LEASE_SECONDS": 1.5, "HEARTBEAT_SECONDS": 0.25}


@pytest.fixture
def keeper() -> Iterator[LeaseKeeper]:
    k = LeaseKeeper()
    yield k
    k.stop()


def test_keeper__partition_interrupts_main_thread_body_before_lapse(
    recorder: RecordingBridge, short_lease: None, keeper: LeaseKeeper
) -> None:
    make_pool("p", 1)
    submit(key="a")
    adm = recorder.admissions[0]
    claim = start(adm.entry_id, adm.token)
    keeper.hold(claim)
    keeper.partitioned = True
    started = time.monotonic()
    with pytest.raises(LeaseLost), body_running():
        time.sleep(10)  # a signal breaks the sleep
    elapsed = time.monotonic() - started
    lost, expires_at = keeper.release(claim.entry_id)
    assert lost
    assert expires_at is not None
    assert timezone.now() < expires_at, "the body must stop before the lease lapses"
    assert elapsed < 1.5


def test_keeper__refused_renewal_interrupts_thread_body(
    recorder: RecordingBridge, short_lease: None, keeper: LeaseKeeper
) -> None:
    make_pool("p", 1)
    submit(key="a")
    adm = recorder.admissions[0]
    outcome: dict[str, object] = {}
    ready = threading.Event()

    def body() -> None:
        claim = start(adm.entry_id, adm.token)
        keeper.hold(claim)
        ready.set()
        try:
            with body_running():
                for _ in range(400):
                    time.sleep(0.01)
            outcome["result"] = "ran to the end"
        except LeaseLost:
            outcome["result"] = "lease lost"
        finally:
            connection.close()

    thread = threading.Thread(target=body)
    thread.start()
    assert ready.wait(5)
    # Another party takes the entry back (as the sweep would after a lapse).
    assert admission.requeue(adm.entry_id, adm.token, reason="test")
    thread.join(10)
    assert outcome.get("result") == "lease lost"


def test_keeper__deferred_completion_lands_when_database_returns(
    recorder: RecordingBridge, short_lease: None, keeper: LeaseKeeper
) -> None:
    make_pool("p", 1)
    submit(key="a")
    submit(key="b")
    adm = recorder.admissions[0]
    claim = start(adm.entry_id, adm.token)
    keeper.partitioned = True
    keeper.defer_settle(claim, "succeeded", claim.lease_expires_at)
    keeper.retry_settles()
    assert QueueEntry.objects.get(key="a").state == EntryState.RUNNING
    keeper.partitioned = False
    keeper.retry_settles()
    assert QueueEntry.objects.get(key="a").state == EntryState.SUCCEEDED
    assert recorder.keys() == ["a", "b"]


def test_cancel_terminate__revokes_running_entry(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    submit(key="a")
    from pools import NotCancellable, cancel

    with pytest.raises(NotCancellable, match="terminate=True"):
        cancel("a")
    entry = cancel("a", terminate=True)
    assert entry.state == EntryState.ADMITTED, "slots are freed once the worker stopped it"
    assert recorder.terminated == ["a"]


def test_keeper__lease_lost_after_the_body_returned_raises_nothing(
    recorder: RecordingBridge, short_lease: None, keeper: LeaseKeeper
) -> None:
    """Celery's own code after the body (result encoding, acks) is never interrupted."""
    make_pool("p", 1)
    submit(key="a")
    adm = recorder.admissions[0]
    claim = start(adm.entry_id, adm.token)
    with body_running():
        keeper.hold(claim)
    keeper.partitioned = True
    deadline = time.monotonic() + 3
    while not keeper.is_lost(claim.entry_id) and time.monotonic() < deadline:
        time.sleep(0.05)  # no LeaseLost may arrive here
    assert keeper.is_lost(claim.entry_id)
    time.sleep(0.3)
    lost, _ = keeper.release(claim.entry_id)
    assert lost, "the claim is still reported lost, so settle requeues instead"
