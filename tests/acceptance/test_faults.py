"""Leases and faults on real workers (SPEC §5): SIGKILL, partition, retries.

Every test here runs with a short lease, LEASE_SECONDS=3 (the heartbeat renews every
1 s), and SWEEP_SECONDS=1, in the test process and in the workers and beat it starts
(``short_leases``). Bodies record what they do in files of a shared directory, an
independent witness that survives a SIGKILL of the worker.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path

import pytest
from celery.exceptions import MaxRetriesExceededError

from pools.core import events
from pools.models import Demand, Pool, PoolEvent, QueueEntry
from pools.states import HELD_STATES, EntryState, EventKind
from tests.acceptance import faults_support
from tests.acceptance.conftest import WORKER_TEST_MARKS, StartWorkers
from tests.acceptance.faults_support import (
    LEASE_SECONDS,
    SWEEP_SECONDS,
    Beat,
    intervals,
    max_overlap,
    read_notes,
    wait_for,
    wait_notes,
)
from tests.testapp.fault_tasks import (
    KILL_POOL,
    PARTITION_POOL,
    RETRY_POOL,
    die_once,
    hold_retry_pool,
    kill_span,
    partitioned,
    retry_always,
    retry_once,
)

pytestmark = WORKER_TEST_MARKS

short_leases = faults_support.short_leases
shared_dir = faults_support.shared_dir
celery_beat = faults_support.celery_beat

#: Slack on top of lease + sweep interval for a loaded 2-core machine.
MARGIN = 4.0
TIMEOUT = 60


def ts(value: datetime | None) -> float:
    assert value is not None, "a time that must be set is missing"
    return value.timestamp()


def entries_of(key: str) -> list[tuple[int, str]]:
    """``(attempt, state)`` of every entry of one Celery task id, oldest first."""
    return list(
        QueueEntry.objects.filter(key=key).order_by("queue_id").values_list("attempt", "state")
    )


def wait_entries(key: str, expected: Sequence[tuple[int, str]], timeout: float = 30) -> None:
    wait_for(lambda: entries_of(key) == expected, timeout, f"entries of {key} to be {expected}")


# --------------------------------------------------------------------------- SIGKILL


def test_faults__sigkilled_worker_claims_return_through_the_beat_sweep(
    short_leases: None,
    celery_workers: StartWorkers,
    celery_beat: Callable[[], Beat],
    shared_dir: Path,
) -> None:
    """Kill -9 a worker running two pooled bodies of a 2-slot pool (lease 3 s, sweep 1 s).

    The real beat's sweep must requeue both entries once their leases lapse and admit them
    again on the surviving worker; every task completes, and the body recorder shows at
    most two bodies at any instant (a killed body counts until the moment of the kill).
    """
    slots = 2
    Pool.objects.create(name=KILL_POOL, slots=slots)
    pool = Pool.objects.get(name=KILL_POOL)
    where = str(shared_dir)
    (doomed,) = celery_workers(count=1, concurrency=3)
    beat = celery_beat()

    results = [kill_span.delay(i, where, doomed.name, 0.5) for i in range(4)]
    keys = [r.id for r in results]

    def victims_running() -> list[str] | None:
        running = list(
            QueueEntry.objects.filter(
                key__in=keys, state=EntryState.RUNNING, worker=doomed.name
            ).values_list("key", flat=True)
        )
        return running if len(running) == slots else None

    victims = set(wait_for(victims_running, 30, "two bodies running on the doomed worker"))
    wait_notes(shared_dir, "spans", lambda ns: len(ns) == slots, 10, "both bodies to start")

    (survivor,) = celery_workers(count=1, concurrency=3)
    # The doomed bodies still hold the pool; the other two wait in line.
    states = dict(QueueEntry.objects.filter(key__in=keys).values_list("key", "state"))
    assert {k for k, s in states.items() if s == EntryState.RUNNING} == victims
    assert {k for k, s in states.items() if s == EntryState.WAITING} == set(keys) - victims

    killed_at = time.time()
    os.killpg(doomed.proc.pid, signal.SIGKILL)
    doomed.proc.wait(timeout=10)
    time.sleep(0.3)  # a renewal in flight at the kill may still land; read the leases after it
    leases = dict(QueueEntry.objects.filter(key__in=victims).values_list("key", "lease_expires_at"))
    assert all(v is not None for v in leases.values())
    assert max(ts(v) for v in leases.values()) <= killed_at + LEASE_SECONDS + 0.5

    # Recovery: requeued by the sweep after the lapse, then admitted again (token 2).
    bound = LEASE_SECONDS + SWEEP_SECONDS + MARGIN
    held_samples: list[int] = []

    def readmitted() -> bool:
        held_samples.append(Demand.objects.held_slots(pool.pk))
        # The entry carries its last admission (no event row for it): token 2 = readmitted.
        return QueueEntry.objects.filter(
            key__in=victims, token__gte=2, admitted_at__isnull=False
        ).count() == len(victims)

    wait_for(readmitted, bound, f"re-admission within {bound:.0f}s of the kill", 0.05)
    assert max(held_samples) <= slots

    values = [r.get(timeout=TIMEOUT) for r in results]

    rows = PoolEvent.objects.filter(key__in=victims, kind=EventKind.REQUEUED).order_by("id")
    requeued = {e.key: e for e in rows}
    # The last admission and start of each victim are on its entry (the stream's events).
    entries = {e.key: e for e in QueueEntry.objects.filter(key__in=victims)}
    stream = events.stream(entries.values(), rows)
    admitted = {e.key: e for e in stream if e.kind == EventKind.ADMITTED}
    started = {e.key: e for e in stream if e.kind == EventKind.STARTED}
    assert set(requeued) == set(admitted) == set(started) == victims
    print(
        f"\nSIGKILL recovery (lease {LEASE_SECONDS:.0f}s, heartbeat 1s, sweep {SWEEP_SECONDS:.0f}s):"
    )
    for key in sorted(victims):
        req, adm, sta = requeued[key], admitted[key], started[key]
        assert req.detail.get("reason") == "lease lapsed", req.detail
        assert (adm.token, sta.token) == (2, 2)
        assert sta.detail.get("worker") == survivor.name
        # Never before the lease lapsed (no slot re-issued early), and within the bound.
        assert ts(req.at) >= ts(leases[key]), "requeued before its lease lapsed"
        assert ts(adm.at) - killed_at <= bound
        print(
            f"  entry {req.entry_id}: lease lapsed kill+{ts(leases[key]) - killed_at:.2f}s, "
            f"requeued kill+{ts(req.at) - killed_at:.2f}s, re-admitted "
            f"kill+{ts(adm.at) - killed_at:.2f}s, started on survivor "
            f"kill+{ts(sta.at) - killed_at:.2f}s"
        )
    print(f"  beat sent {beat.sweeps_sent()} sweeps during the test")

    # Every task completed on the survivor; the killed ones on their second admission.
    assert [v["i"] for v in values] == list(range(4))
    assert all(v["hostname"] == survivor.name and not v["doomed"] for v in values)
    assert {v["key"]: v["token"] for v in values} == {k: 2 if k in victims else 1 for k in keys}
    wait_for(
        lambda: (
            set(QueueEntry.objects.filter(key__in=keys).values_list("state", flat=True))
            == {EntryState.SUCCEEDED}
        ),
        30,
        "every entry to settle",
    )
    assert QueueEntry.objects.filter(key__in=keys).count() == len(keys), "requeue keeps the entry"

    # The independent witness: no slot held twice, the killed bodies counted until the kill.
    spans = intervals(read_notes(shared_dir, "spans"), killed_at=killed_at)
    attempts = sorted((n["key"], n["token"], n["hostname"]) for _, _, n in spans)
    expected = sorted(
        [(k, 1, doomed.name) for k in victims]
        + [(k, 2, survivor.name) for k in victims]
        + [(k, 1, survivor.name) for k in set(keys) - victims]
    )
    assert attempts == expected
    peak = max_overlap([(s, e) for s, e, _ in spans])
    assert peak <= slots, f"{peak} bodies overlapped in a {slots}-slot pool"
    assert peak == slots, "the pool was never full: the overlap check proves little"
    restarts = [s for s, _, n in spans if n["token"] == 2]
    assert min(restarts) > killed_at


def test_faults__killed_pool_process_is_requeued_without_waiting_for_the_lease(
    celery_workers: StartWorkers, shared_dir: Path
) -> None:
    """SIGKILL one prefork child running a pooled body (default 30 s lease, no beat).

    The worker's main process reports ``WorkerLostError``; the entry must go back in line
    at once (reason "worker lost") and run again, long before its lease would lapse.
    """
    Pool.objects.create(name=KILL_POOL, slots=1)
    # Celery logs the lost process as an ERROR: expected here.
    celery_workers(count=1, concurrency=2, allow_errors=True)
    result = die_once.delay(str(shared_dir))
    (first,) = wait_notes(shared_dir, "spans", lambda ns: len(ns) == 1, 30, "the first attempt")
    lease_end = ts(QueueEntry.objects.get(key=result.id).lease_expires_at)
    killed_at = time.time()
    os.kill(first["pid"], signal.SIGKILL)
    assert lease_end - killed_at > 20, "the lease is too short for this test to mean anything"

    wait_for(
        lambda: QueueEntry.objects.get(key=result.id).state == EntryState.SUCCEEDED,
        30,
        "the killed entry to run again and succeed",
    )
    requeued = PoolEvent.objects.get(key=result.id, kind=EventKind.REQUEUED)
    assert requeued.detail.get("reason") == "worker lost", requeued.detail
    assert ts(requeued.at) - killed_at < 10, "requeued only when the lease lapsed"
    second = QueueEntry.objects.get(key=result.id, token=2)  # it carries its last start
    assert second.started_at is not None
    print(
        f"\nkilled child: requeued kill+{ts(requeued.at) - killed_at:.2f}s, started again "
        f"kill+{ts(second.started_at) - killed_at:.2f}s (lease would have lapsed at "
        f"kill+{lease_end - killed_at:.1f}s)"
    )
    notes = read_notes(shared_dir, "spans")
    assert [(n["event"], n["token"]) for n in notes] == [("start", 1), ("start", 2), ("end", 2)]
    assert notes[1]["pid"] != first["pid"]


# --------------------------------------------------------------------------- partition


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_faults__partitioned_body_gets_lease_lost_before_the_lease_lapses(
    pool: str, short_leases: None, celery_workers: StartWorkers, shared_dir: Path
) -> None:
    """A body whose process cannot renew (``simulate_partition``) is stopped with ``LeaseLost``.

    Lease 3 s, heartbeat 1 s. The first attempt loops for three leases; the keeper must
    interrupt it while the lease it holds in the database is still valid. The entry is
    then requeued and its second admission succeeds; that attempt runs longer than a
    lease in the same process, so it passes only if the partition was switched off.
    Under ``-P threads`` the interruption is ``PyThreadState_SetAsyncExc``.
    """
    Pool.objects.create(name=PARTITION_POOL, slots=1)
    # One process / one thread: the second attempt runs where the partition happened.
    (worker,) = celery_workers(count=1, concurrency=1, pool=pool)
    where = str(shared_dir)
    result = partitioned.delay(where, 3 * LEASE_SECONDS, 1.5 * LEASE_SECONDS)
    value = result.get(timeout=TIMEOUT)

    notes = read_notes(shared_dir, "partition")
    assert [n["event"] for n in notes] == ["start", "interrupted", "second"], notes
    start, stop, second = notes
    assert stop["pid"] == start["pid"] and stop["thread"] == start["thread"]
    # Still held under its token (admitted after a fenced start until a renewal lands).
    assert stop["db_state"] in HELD_STATES and stop["db_token"] == 1, stop
    assert stop["lease_expires_at"] is not None
    margin = stop["lease_expires_at"] - stop["interrupted_at"]
    print(
        f"\n[{pool}] LeaseLost after {stop['interrupted_at'] - stop['started']:.2f}s of "
        f"partition, {margin:.2f}s before the lease (3s, heartbeat 1s) would lapse"
    )
    assert margin > 0, f"the body was stopped {-margin:.2f}s after its lease lapsed"

    # The second admission ran (and returned) after the first body had stopped.
    assert value["attempt"] == value["token"] == 2, value
    assert value["key"] == result.id and value["hostname"] == worker.name
    assert second["t"] > stop["interrupted_at"]
    assert second["pid"] == start["pid"], "the second attempt ran in the partitioned process"
    entry = QueueEntry.objects.get(key=result.id)
    wait_for(
        lambda: QueueEntry.objects.filter(key=result.id, state=EntryState.SUCCEEDED).exists(),
        30,
        "the entry to settle",
    )
    entry.refresh_from_db()
    assert entry.token == 2
    requeued = PoolEvent.objects.get(key=result.id, kind=EventKind.REQUEUED)
    assert requeued.detail.get("reason") == "lease lost"
    assert requeued.token == 1
    print(
        f"[{pool}] requeued {ts(requeued.at) - stop['interrupted_at']:.3f}s after the "
        f"interruption, {stop['lease_expires_at'] - ts(requeued.at):.2f}s before the lapse"
    )


# --------------------------------------------------------------------------- retries


def test_faults__retry_waits_in_line_without_consuming_attempts(
    short_leases: None,
    celery_workers: StartWorkers,
    celery_beat: Callable[[], Beat],
    shared_dir: Path,
) -> None:
    """``self.retry(countdown=0.2)`` re-enters the pool as attempt 1 and waits behind a holder.

    Lease 3 s, sweep 1 s (the real beat). While the holder keeps the 1-slot pool busy for
    several sweeps, the retry stays one waiting entry with attempt 1; when it finally runs
    ``self.request.retries`` is 1.
    """
    Pool.objects.create(name=RETRY_POOL, slots=1)
    celery_workers(count=1, concurrency=3)
    beat = celery_beat()
    where = str(shared_dir)

    result = retry_once.delay(where)
    wait_notes(shared_dir, "retry-once", lambda ns: len(ns) == 1, 30, "attempt 0 to start")
    holder = hold_retry_pool.delay(where, "h")
    assert entries_of(holder.id) == [(0, EntryState.WAITING)]
    (shared_dir / "go").touch()  # attempt 0 now calls self.retry(countdown=0.2)

    wait_notes(shared_dir, "holder", lambda ns: len(ns) == 1, 30, "the holder to start")
    wait_entries(result.id, [(0, EntryState.RETRIED), (1, EntryState.WAITING)])
    # Let several sweeps pass while the retry waits behind the holder.
    sweeps = beat.sweeps_sent()
    wait_for(lambda: beat.sweeps_sent() >= sweeps + 3, 15, "three more sweeps")
    assert entries_of(result.id) == [(0, EntryState.RETRIED), (1, EntryState.WAITING)]
    assert result.state == "RETRY"
    assert len(read_notes(shared_dir, "retry-once")) == 1, "the retry ran while waiting"

    (shared_dir / "release-h").touch()
    value = result.get(timeout=TIMEOUT)
    assert holder.get(timeout=TIMEOUT) == "h"
    assert value["retries"] == 1
    wait_entries(result.id, [(0, EntryState.RETRIED), (1, EntryState.SUCCEEDED)])
    bodies = read_notes(shared_dir, "retry-once")
    assert [(n["retries"], n["token"]) for n in bodies] == [(0, 1), (1, 1)]
    first, final = QueueEntry.objects.filter(key=result.id).order_by("queue_id")
    assert [n["entry_id"] for n in bodies] == [first.queue_id, final.queue_id]
    assert value["entry_id"] == final.queue_id
    # The retry was admitted when the holder settled, not before.
    holder_settled = QueueEntry.objects.get(key=holder.id).finished_at
    final.refresh_from_db()
    assert final.admitted_at is not None and holder_settled is not None
    assert final.admitted_at >= holder_settled


def test_faults__retry_exhaustion_fails_like_plain_celery(
    short_leases: None,
    celery_workers: StartWorkers,
    celery_beat: Callable[[], Beat],
    shared_dir: Path,
) -> None:
    """``max_retries=2`` exhausted: FAILURE with the ``exc`` given to ``retry`` or
    ``MaxRetriesExceededError``, after attempts 0, 1 (retried) and 2 (failed).

    Lease 3 s, sweep 1 s: each countdown retry is admitted by the beat's sweep.
    """
    Pool.objects.create(name=RETRY_POOL, slots=2)
    celery_workers(count=1, concurrency=3)
    celery_beat()
    where = str(shared_dir)
    with_exc = retry_always.delay(where, True)
    without = retry_always.delay(where, False)

    with pytest.raises(ValueError, match="boom on try 2"):
        with_exc.get(timeout=TIMEOUT)
    with pytest.raises(MaxRetriesExceededError):
        without.get(timeout=TIMEOUT)
    assert (with_exc.state, without.state) == ("FAILURE", "FAILURE")
    expected = [(0, EntryState.RETRIED), (1, EntryState.RETRIED), (2, EntryState.FAILED)]
    wait_entries(with_exc.id, expected)
    wait_entries(without.id, expected)
    for flag in (True, False):
        bodies = read_notes(shared_dir, f"retry-always-{flag}")
        assert [n["retries"] for n in bodies] == [0, 1, 2]
