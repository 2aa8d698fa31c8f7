"""Every way a pooled body ends settles its entry exactly once, with real prefork workers.

One test per way Celery ends an attempt (or holds a message before it starts) that needs
the worker's main process: a hard time limit on a body stuck in C, a pool process killed
by a signal, the whole process group stopped (``systemctl stop``), and the three ways a
worker holds a received message unstarted (Celery's ``rate_limit``, an ETA, prefetch
behind a busy process). Bodies note each run in ``<shared>/runs.jsonl``; each test checks
how many times every body ran, the entry's final state, and that the next call ran.

These tests also run on the lowest Celery and Django versions declared (``make
test-lowest``): before 5.7 Celery's ``task_failure`` in the main process carries no
request, so the claim must come from what the worker recorded when it received the message.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from celery.exceptions import TimeLimitExceeded
from celery.result import AsyncResult

from pools.celery import sending
from pools.core import sweeps
from pools.models import Pool, PoolEvent, QueueEntry
from pools.states import EntryState, EventKind
from tests.acceptance import faults_support
from tests.acceptance.conftest import WORKER_TEST_MARKS, StartWorkers
from tests.acceptance.faults_support import (
    LEASE_SECONDS,
    SWEEP_SECONDS,
    Beat,
    read_notes,
    wait_for,
    wait_notes,
)
from tests.testapp.fault_tasks import ENDS_POOL, RATED_POOL, counted, hang_in_c, rated, signalled

pytestmark = WORKER_TEST_MARKS

short_leases = faults_support.short_leases
shared_dir = faults_support.shared_dir
celery_beat = faults_support.celery_beat

TIMEOUT = 90


def runs(where: Path) -> Counter[str]:
    """How many times each named call's body started."""
    return Counter(n["name"] for n in read_notes(where, "runs") if n["event"] == "start")


def starts(where: Path, name: str) -> list[dict[str, Any]]:
    return [n for n in read_notes(where, "runs") if n["event"] == "start" and n["name"] == name]


def state_of(key: str) -> tuple[str, int]:
    entry = QueueEntry.objects.get(key=key)
    return entry.state, entry.token


def wait_settled(keys: list[str], timeout: float = TIMEOUT) -> dict[str, tuple[str, int]]:
    """Wait until no entry of ``keys`` is waiting or held; return ``{key: (state, token)}``."""
    open_states = {EntryState.WAITING, EntryState.ADMITTED, EntryState.RUNNING}

    def settled() -> dict[str, tuple[str, int]] | None:
        found = {k: state_of(k) for k in keys}
        return None if any(s in open_states for s, _ in found.values()) else found

    result: dict[str, tuple[str, int]] = wait_for(settled, timeout, f"entries {keys} to settle")
    return result


def succeeded(key: str) -> bool:
    """The result backend holds SUCCESS for ``key`` (the final result)."""
    return bool(AsyncResult(key).state == "SUCCESS")


def requeues(key: str) -> list[str]:
    rows = PoolEvent.objects.filter(key=key, kind=EventKind.REQUEUED).order_by("id")
    return [str(e.detail.get("reason")) for e in rows]


def let_sweeps_pass(beat: Beat, count: int) -> None:
    """Give the beat's sweep ``count`` more passes (each could requeue a lapsed lease)."""
    sent = beat.sweeps_sent()
    wait_for(lambda: beat.sweeps_sent() >= sent + count, 30 + count * SWEEP_SECONDS, "sweeps")


# --------------------------------------------------------------------------- hard time limit


@pytest.mark.parametrize("limit", [2, 15], ids=["task-limit-2s", "call-limit-15s"])
def test_ends__hard_time_limit_in_c_fails_the_entry_once_and_the_next_call_runs(
    limit: int,
    short_leases: None,
    celery_workers: StartWorkers,
    celery_beat: Callable[[], Beat],
    shared_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    settings: Any,
) -> None:
    """A hard time limit on ``sum(range(10**11))``: billiard kills the process, Celery
    stores FAILURE(TimeLimitExceeded); the body started once, the entry ends ``failed`` and
    never runs again, and the call behind it runs.

    Lease 6 s, sweep 1 s: an entry left ``running`` would be re-run by the sweep after
    every lapse, so the check waits several leases after the next call has finished. The
    task's own ``time_limit=2`` is below the lease; the call's ``time_limit=15`` is above
    it: the C call holds the GIL, its pool process renews nothing, and the worker's main
    process must keep the claim until the limit (else a second copy runs beside it on the
    worker's other pool process).
    """
    lease = 2 * LEASE_SECONDS
    monkeypatch.setenv("POOLS_LEASE_SECONDS", str(lease))
    settings.POOLS = {**settings.POOLS, "LEASE_SECONDS": lease}
    Pool.objects.create(name=ENDS_POOL, slots=1)
    # Celery logs the hard time limit and the killed process as ERRORs: expected here.
    celery_workers(count=1, concurrency=2, allow_errors=True)
    beat = celery_beat()
    where = str(shared_dir)
    hung = (
        hang_in_c.delay(where) if limit == 2 else hang_in_c.apply_async((where,), time_limit=limit)
    )
    after = counted.delay(where, "after")

    with pytest.raises(TimeLimitExceeded):
        hung.get(timeout=TIMEOUT, propagate=True)
    failed_at = time.time()
    first = starts(shared_dir, "hang")[0]
    assert after.get(timeout=TIMEOUT)["name"] == "after"
    states = wait_settled([hung.id, after.id])
    let_sweeps_pass(beat, round(3 * lease / SWEEP_SECONDS))

    print(
        f"\nhard time limit {limit}s, lease {lease:.0f}s: FAILURE seen "
        f"{failed_at - first['t']:.1f}s after the body started; hang runs "
        f"{runs(shared_dir)['hang']}, requeues {requeues(hung.id)}"
    )
    if limit > lease:  # meaningful only if the body really outlived its lease
        assert failed_at - first["t"] > 2 * lease, "the body did not outlive its lease"
    assert runs(shared_dir) == {"hang": 1, "after": 1}, "a hard-time-limited body ran again"
    assert requeues(hung.id) == []
    assert states == {hung.id: (EntryState.FAILED, 1), after.id: (EntryState.SUCCEEDED, 1)}
    assert state_of(hung.id) == (EntryState.FAILED, 1)
    assert AsyncResult(hung.id).state == "FAILURE"


# --------------------------------------------------------------------------- signals


@pytest.mark.parametrize("signame", ["SIGKILL", "SIGTERM", "SIGQUIT"])
def test_ends__signalled_pool_process_requeues_its_entry_at_once(
    signame: str, celery_workers: StartWorkers, shared_dir: Path
) -> None:
    """A signal that ends the pool process under a pooled body (default 30 s lease, no beat).

    The entry goes back in line at once ("worker lost") and runs again, long before its
    lease could lapse; the rerun's SUCCESS is the final result, and the call queued behind
    it runs once.
    """
    Pool.objects.create(name=ENDS_POOL, slots=1)
    # Celery logs the lost process as an ERROR: expected here.
    (worker,) = celery_workers(count=1, concurrency=2, allow_errors=True)
    where = str(shared_dir)
    victim = signalled.delay(where, "victim", worker.name)
    after = counted.delay(where, "after")
    (first,) = wait_notes(
        shared_dir, "runs", lambda ns: len(ns) == 1, 30, "the first attempt to start"
    )
    lease_end = QueueEntry.objects.get(key=victim.id).lease_expires_at
    assert lease_end is not None
    killed_at = time.time()
    os.kill(first["pid"], getattr(signal, signame))
    assert lease_end.timestamp() - killed_at > 20, "the lease is too short to tell a requeue"

    states = wait_settled([victim.id, after.id], timeout=60)
    assert states == {victim.id: (EntryState.SUCCEEDED, 2), after.id: (EntryState.SUCCEEDED, 1)}, (
        list(PoolEvent.objects.filter(key=victim.id).values_list("kind", "detail", "at")),
        read_notes(shared_dir, "runs"),
        killed_at,
    )
    assert requeues(victim.id) == ["worker lost"]
    requeued = PoolEvent.objects.get(key=victim.id, kind=EventKind.REQUEUED)
    print(
        f"\n{signame} to a pool process: requeued kill+{requeued.at.timestamp() - killed_at:.2f}s"
    )
    assert requeued.at.timestamp() < lease_end.timestamp() - 10, "requeued only at the lapse"
    assert runs(shared_dir) == {"victim": 2, "after": 1}
    second = starts(shared_dir, "victim")[1]
    assert (second["token"], second["pid"] != first["pid"]) == (2, True)
    wait_for(functools.partial(succeeded, victim.id), 30, "the rerun's result")
    assert AsyncResult(after.id).get(timeout=30)["name"] == "after"


def test_ends__sigint_to_a_pool_process_is_ignored_and_the_body_finishes_once(
    celery_workers: StartWorkers, shared_dir: Path
) -> None:
    """Celery's pool processes ignore SIGINT (only the main process handles Ctrl-C): the
    attempt is not ended, it finishes and settles once."""
    Pool.objects.create(name=ENDS_POOL, slots=1)
    (worker,) = celery_workers(count=1, concurrency=2)
    where = str(shared_dir)
    victim = signalled.delay(where, "victim", worker.name)
    after = counted.delay(where, "after")
    (first,) = wait_notes(shared_dir, "runs", lambda ns: len(ns) == 1, 30, "the attempt to start")
    os.kill(first["pid"], signal.SIGINT)
    time.sleep(1.0)  # a handled SIGINT would have ended the body by now
    (shared_dir / "go-victim").touch()
    assert victim.get(timeout=TIMEOUT)["token"] == 1
    states = wait_settled([victim.id, after.id])
    assert states == {victim.id: (EntryState.SUCCEEDED, 1), after.id: (EntryState.SUCCEEDED, 1)}
    assert runs(shared_dir) == {"victim": 1, "after": 1}


def test_ends__sigterm_to_the_whole_process_group_reruns_the_running_calls(
    celery_workers: StartWorkers, shared_dir: Path
) -> None:
    """``systemctl stop`` with ``KillMode=control-group`` (or ``pkill``): SIGTERM reaches the
    main process and every pool process at once, while two bodies run (default lease).

    Every call still runs to success at least once (the two cut off run again on the
    other worker), none ends failed, and the pool is empty afterwards.
    """
    pool = Pool.objects.create(name=ENDS_POOL, slots=2)
    (doomed,) = celery_workers(count=1, concurrency=2, allow_errors=True)
    where = str(shared_dir)
    calls = [signalled.delay(where, f"c{i}", doomed.name) for i in range(4)]
    keys = [c.id for c in calls]
    wait_notes(shared_dir, "runs", lambda ns: len(ns) == 2, 30, "two bodies to run on the worker")
    (survivor,) = celery_workers(count=1, concurrency=2)

    stopped_at = time.time()
    os.killpg(doomed.proc.pid, signal.SIGTERM)
    doomed.proc.wait(timeout=60)

    states = wait_settled(keys, timeout=60)
    assert {s for s, _ in states.values()} == {EntryState.SUCCEEDED}, states
    for call in calls:
        wait_for(functools.partial(succeeded, call.id), 30, f"{call.id} SUCCESS")
    counts = runs(shared_dir)
    assert set(counts) == {f"c{i}" for i in range(4)}
    cut = {n["name"] for n in read_notes(shared_dir, "runs") if n["hostname"] == doomed.name}
    assert len(cut) == 2 and all(counts[name] == 2 for name in cut), counts
    reasons = {c.id: requeues(c.id) for c in calls}
    print(f"\nprocess-group SIGTERM: requeue reasons {sorted(map(str, reasons.values()))}")
    last = max(
        e.at.timestamp() for e in PoolEvent.objects.filter(key__in=keys, kind=EventKind.REQUEUED)
    )
    assert last - stopped_at < 20, "the cut-off calls waited for their lease to lapse"
    assert survivor.alive()
    assert pool.slots == 2


# --------------------------------------------------------------------------- held messages


def test_ends__celery_rate_limit_holds_messages_without_losing_their_lease(
    short_leases: None,
    celery_workers: StartWorkers,
    celery_beat: Callable[[], Beat],
    shared_dir: Path,
) -> None:
    """``rate_limit="6/m"`` on a pooled task (lease 3 s, sweep 1 s): the worker's token
    bucket holds the second and third message 10 s and 20 s, several leases; each runs
    exactly once on its first admission, as in plain Celery."""
    Pool.objects.create(name=RATED_POOL, slots=3)
    celery_workers(count=1, concurrency=2)
    celery_beat()
    where = str(shared_dir)
    calls = [rated.delay(where, f"r{i}") for i in range(3)]
    values = [c.get(timeout=TIMEOUT) for c in calls]
    assert [v["token"] for v in values] == [1, 1, 1]
    states = wait_settled([c.id for c in calls])
    assert set(states.values()) == {(EntryState.SUCCEEDED, 1)}
    assert all(requeues(c.id) == [] for c in calls)
    assert runs(shared_dir) == {"r0": 1, "r1": 1, "r2": 1}
    times = sorted(n["t"] for n in read_notes(shared_dir, "runs"))
    print(f"\nrate_limit 6/m, pooled: starts at +{[round(t - times[0], 1) for t in times]} s")
    # Meaningful only if a message really waited in the bucket longer than a lease.
    assert times[-1] - times[0] > 2 * LEASE_SECONDS, times


def test_ends__eta_held_in_the_worker_keeps_its_lease(
    short_leases: None,
    celery_workers: StartWorkers,
    celery_beat: Callable[[], Beat],
    shared_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A message admitted before its ETA (as clock skew between the database and a worker
    does; here the caller drops the ETA from its admission) waits in the worker several
    leases (3 s) and runs once, at its ETA, on its first admission."""
    original = sending._submission

    def no_wait(*args: Any, **kwargs: Any) -> Any:
        return dataclasses.replace(original(*args, **kwargs), not_before=None)

    monkeypatch.setattr(sending, "_submission", no_wait)
    Pool.objects.create(name=ENDS_POOL, slots=1)
    celery_workers(count=1, concurrency=2)
    celery_beat()
    where = str(shared_dir)
    called_at = time.time()
    eta = counted.apply_async((where, "eta"), countdown=3 * LEASE_SECONDS)
    wait_for(lambda: state_of(eta.id)[0] == EntryState.ADMITTED, 30, "the ETA call to be admitted")
    after = counted.delay(where, "after")
    assert eta.get(timeout=TIMEOUT)["token"] == 1
    assert after.get(timeout=TIMEOUT)["token"] == 1
    states = wait_settled([eta.id, after.id])
    assert set(states.values()) == {(EntryState.SUCCEEDED, 1)}
    assert requeues(eta.id) == []
    assert runs(shared_dir) == {"eta": 1, "after": 1}
    (start,) = starts(shared_dir, "eta")
    print(f"\nETA held in the worker: started {start['t'] - called_at:.1f}s after the call")
    assert start["t"] >= called_at + 3 * LEASE_SECONDS - 0.5, "ran before its ETA"


def test_ends__prefetched_message_behind_a_busy_process_keeps_its_lease(
    short_leases: None,
    celery_workers: StartWorkers,
    shared_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prefetch 4, one pool process busy for three leases (3 s): the admitted message the
    worker prefetched behind it keeps its lease, then runs once on its first admission.

    The worker's only process is busy, so a sweep sent to it would wait too: the test
    process sweeps (every 0.5 s) instead of beat.
    """
    monkeypatch.setenv("POOLS_TEST_PREFETCH", "4")
    Pool.objects.create(name=ENDS_POOL, slots=2)
    celery_workers(count=1, concurrency=1)
    where = str(shared_dir)
    busy = counted.delay(where, "busy", 3 * LEASE_SECONDS)
    wait_notes(shared_dir, "runs", lambda ns: len(ns) == 1, 30, "the busy body to start")
    held = counted.delay(where, "held")
    wait_for(lambda: state_of(held.id)[0] == EntryState.ADMITTED, 30, "the second admission")
    after = counted.delay(where, "after")
    calls = (busy, held, after)

    def done() -> bool:
        sweeps.sweep()
        return all(c.ready() for c in calls)

    wait_for(done, TIMEOUT, "the three calls", interval=0.5)
    values = [r.get(timeout=TIMEOUT) for r in calls]
    assert [v["token"] for v in values] == [1, 1, 1]
    states = wait_settled([c.id for c in calls])
    assert set(states.values()) == {(EntryState.SUCCEEDED, 1)}
    assert requeues(held.id) == []
    assert runs(shared_dir) == {"busy": 1, "held": 1, "after": 1}
    (held_start,) = starts(shared_dir, "held")
    admitted_at = QueueEntry.objects.get(key=held.id).admitted_at
    assert admitted_at is not None
    waited = held_start["t"] - admitted_at.timestamp()
    print(f"\nprefetched behind a busy process: started {waited:.1f}s after its admission")
    # Meaningful only if the message really waited in the worker longer than a lease.
    assert waited > LEASE_SECONDS
