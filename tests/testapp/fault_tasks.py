"""Pooled tasks for the fault-tolerance acceptance tests (leases, retries, results).

Each test creates the pool its tasks name (the names are not in ``settings.POOLS``), so
every test gets a dedicated pool. Bodies report what happened through files in a
directory shared with the test process (``where``): it is an independent record that
survives a ``SIGKILL`` of the worker and does not depend on the result backend.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from celery import current_task, shared_task
from celery.exceptions import MaxRetriesExceededError

from pools import LeaseLost, current_claim, pooled

#: Pool of the SIGKILL test.
KILL_POOL = "faults-kill"
#: Pool of the partition (lease lost) tests.
PARTITION_POOL = "faults-partition"
#: Pool of the result tests (expiry, cancel, chord).
RESULTS_POOL = "faults-results"
#: Pool of the retry tests.
RETRY_POOL = "faults-retry"

#: Bound on every wait inside a body, so a failing test never leaves a body running long.
MAX_WAIT = 60.0


def note(where: str, stream: str, **fields: Any) -> None:
    """Append one JSON line to ``<where>/<stream>.jsonl`` (one ``write``, closed at once)."""
    fields.setdefault("t", time.time())
    fields.setdefault("pid", os.getpid())
    line = json.dumps(fields, sort_keys=True) + "\n"
    with open(Path(where) / f"{stream}.jsonl", "a") as fh:
        fh.write(line)


def _context() -> dict[str, Any]:
    claim = current_claim()
    request = current_task.request if current_task else None
    return {
        "key": getattr(request, "id", None),
        "hostname": getattr(request, "hostname", None),
        "retries": getattr(request, "retries", None),
        "entry_id": claim.entry_id if claim else None,
        "token": claim.token if claim else None,
        "pid": os.getpid(),
        "thread": threading.get_ident(),
    }


def _sleep_until(deadline: float, step: float = 0.02) -> None:
    # Small steps: under the threads pool LeaseLost arrives between bytecodes only.
    while time.time() < deadline:
        time.sleep(step)


def _wait_file(path: Path, timeout: float = MAX_WAIT) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if path.exists():
            return True
        time.sleep(0.02)
    return False


# --------------------------------------------------------------------------- SIGKILL


@shared_task
@pooled(KILL_POOL, slots=1)
def kill_span(i: int, where: str, doomed: str, seconds: float = 0.5) -> dict[str, Any]:
    """Record start/end; on worker ``doomed`` run (practically) forever, to be killed there."""
    ctx = _context()
    note(where, "spans", event="start", i=i, **ctx)
    on_doomed = ctx["hostname"] == doomed
    _sleep_until(time.time() + (MAX_WAIT if on_doomed else seconds))
    note(where, "spans", event="end", i=i, **ctx)
    return {"i": i, "doomed": on_doomed, **ctx}


@shared_task
@pooled(KILL_POOL, slots=1)
def die_once(where: str) -> dict[str, Any]:
    """The first attempt waits to be killed (its pid is in the start note); later ones return."""
    ctx = _context()
    note(where, "spans", event="start", **ctx)
    if ctx["token"] == 1:
        _sleep_until(time.time() + MAX_WAIT)
    note(where, "spans", event="end", **ctx)
    return ctx


# --------------------------------------------------------------------------- partition


@shared_task
@pooled(PARTITION_POOL, slots=1)
def partitioned(where: str, loop_seconds: float, second_seconds: float) -> dict[str, Any]:
    """First admission: cut this process off from lease renewals and loop past the lease.

    The keeper must stop the loop with ``LeaseLost`` before the lease lapses; the moment is
    recorded (with the lease expiry the database holds then) and the exception re-raised.
    A later admission (token > 1) runs ``second_seconds`` (longer than a lease: it needs
    working renewals, i.e. a process no longer partitioned) and returns.
    """
    ctx = _context()
    claim = current_claim()
    assert claim is not None
    if claim.token != 1:
        note(where, "partition", event="second", **ctx)
        _sleep_until(time.time() + second_seconds)
        return {"attempt": claim.token, **ctx}
    # Imported here: this module is imported by workers and beat, keep it model-free.
    from pools.models import QueueEntry
    from pools.testing import simulate_partition

    simulate_partition()
    started = time.time()
    note(where, "partition", event="start", **ctx)
    try:
        _sleep_until(started + loop_seconds)
    except LeaseLost:
        interrupted_at = time.time()
        row = (
            QueueEntry.objects.filter(pk=claim.entry_id)
            .values("lease_expires_at", "state", "token")
            .first()
        )
        assert row is not None
        expires = row["lease_expires_at"]
        note(
            where,
            "partition",
            event="interrupted",
            interrupted_at=interrupted_at,
            lease_expires_at=expires.timestamp() if expires else None,
            db_state=row["state"],
            db_token=row["token"],
            started=started,
            **ctx,
        )
        raise
    finally:
        simulate_partition(False)
    note(where, "partition", event="not-interrupted", **ctx)
    return {"attempt": claim.token, "interrupted": False, **ctx}


# --------------------------------------------------------------------------- results


@shared_task
@pooled(RESULTS_POOL, slots=1)
def hold_results_pool(where: str, name: str) -> str:
    """Hold the results pool until the test writes ``<where>/release-<name>``."""
    note(where, "holder", event="start", name=name, **_context())
    released = _wait_file(Path(where) / f"release-{name}")
    return name if released else f"{name}: never released"


@shared_task
@pooled(RESULTS_POOL, slots=1)
def queued_member(where: str, value: int) -> int:
    """A pooled task that waits behind the holder; records it if it ever runs."""
    note(where, "members", event="ran", value=value, **_context())
    return value


@shared_task
def plain_echo(value: int) -> int:
    """Not pooled: completes at once."""
    return value


@shared_task
def collect(values: list[int]) -> list[int]:
    """Not pooled chord body."""
    return values


@shared_task
def note_errback(task_id: str, *, where: str) -> str:
    """A ``link_error`` callback called the classic way, as a task with the failed id.

    ``where`` is keyword-only on purpose: Celery calls an errback whose function takes
    more than one positional argument inline with ``(request, exc, traceback)`` instead.
    """
    note(where, "errbacks", task_id=task_id, hostname=current_task.request.hostname)
    return task_id


@shared_task
def note_errback_inline(request: Any, exc: BaseException, traceback: Any, where: str) -> None:
    """A ``link_error`` callback with the ``(request, exc, traceback)`` signature (run inline)."""
    note(
        where,
        "inline-errbacks",
        task_id=request.id,
        exc_type=type(exc).__name__,
        exc_module=type(exc).__module__,
        exc=str(exc),
    )


# --------------------------------------------------------------------------- retries


@shared_task
@pooled(RETRY_POOL, slots=1)
def hold_retry_pool(where: str, name: str) -> str:
    """Hold the retry pool until the test writes ``<where>/release-<name>``."""
    note(where, "holder", event="start", name=name, **_context())
    released = _wait_file(Path(where) / f"release-{name}")
    return name if released else f"{name}: never released"


@shared_task(bind=True, max_retries=3)
@pooled(RETRY_POOL, slots=1)
def retry_once(self: Any, where: str) -> dict[str, Any]:
    """Attempt 0 waits for ``<where>/go`` then retries (countdown 0.2 s); attempt 1 returns."""
    ctx = _context()
    note(where, "retry-once", **ctx)
    if self.request.retries == 0:
        _wait_file(Path(where) / "go")
        raise self.retry(countdown=0.2)
    return ctx


# ``throws``: plain Celery's way to say these failures are expected; the worker logs them at
# INFO instead of ERROR (the acceptance workers fail a test that logs errors). The result
# is the same FAILURE.
@shared_task(bind=True, max_retries=2, throws=(ValueError, MaxRetriesExceededError))
@pooled(RETRY_POOL, slots=1)
def retry_always(self: Any, where: str, with_exc: bool) -> None:
    """Retries on every attempt until ``max_retries`` (2) is exhausted."""
    note(where, f"retry-always-{with_exc}", **_context())
    if with_exc:
        raise self.retry(exc=ValueError(f"boom on try {self.request.retries}"), countdown=0.1)
    raise self.retry(countdown=0.1)


# --------------------------------------------------------------------------- network partition

#: Pool of the network-partition tests (1 slot).
NET_POOL = "faults-net-partition"


@shared_task
@pooled(NET_POOL, slots=1)
def ticking(where: str, seconds: float, tick: float = 0.25) -> dict[str, Any]:
    """A body that shows it is alive: a ``tick`` line every ``tick`` seconds for ``seconds``.

    Lines go to ``<where>/ticks.jsonl`` with the attempt (key, token, pid, hostname): the
    last line an attempt wrote is its last sign of life, whatever stopped it. ``LeaseLost``
    is noted (``lost``) and re-raised.
    """
    ctx = _context()
    note(where, "ticks", event="start", **ctx)
    end = time.time() + seconds
    try:
        while time.time() < end:
            note(where, "ticks", event="tick", **ctx)
            _sleep_until(min(end, time.time() + tick))
    except LeaseLost:
        note(where, "ticks", event="lost", **ctx)
        raise
    note(where, "ticks", event="end", **ctx)
    return ctx


# --------------------------------------------------------------------------- every end

#: Pool of the "every way a body ends" tests (hard time limit, signals, held messages).
ENDS_POOL = "faults-ends"
#: Pool of the Celery ``rate_limit`` test.
RATED_POOL = "faults-rated"


@shared_task(time_limit=2, throws=(Exception,))
@pooled(ENDS_POOL, slots=1)
def hang_in_c(where: str) -> int:
    """Stuck in one C call that never checks for signals: only the hard time limit stops it."""
    note(where, "runs", event="start", name="hang", **_context())
    return sum(range(10**11))


@shared_task
@pooled(ENDS_POOL, slots=1)
def counted(where: str, name: str, seconds: float = 0.0) -> dict[str, Any]:
    """Record each run (start and end) of call ``name``; sleep ``seconds`` in between."""
    ctx = _context()
    note(where, "runs", event="start", name=name, **ctx)
    _sleep_until(time.time() + seconds)
    note(where, "runs", event="end", name=name, **ctx)
    return {"name": name, **ctx}


@shared_task
@pooled(ENDS_POOL, slots=1)
def signalled(where: str, name: str, doomed: str) -> dict[str, Any]:
    """Its first attempt on worker ``doomed`` waits for a signal (or ``<where>/go-<name>``)."""
    ctx = _context()
    note(where, "runs", event="start", name=name, **ctx)
    if ctx["token"] == 1 and ctx["hostname"] == doomed:
        _wait_file(Path(where) / f"go-{name}")
    note(where, "runs", event="end", name=name, **ctx)
    return {"name": name, **ctx}


@shared_task(rate_limit="6/m")
@pooled(RATED_POOL, slots=1)
def rated(where: str, name: str) -> dict[str, Any]:
    """Celery's own per-worker ``rate_limit`` on a pooled task: one start per 10 s."""
    ctx = _context()
    note(where, "runs", event="start", name=name, **ctx)
    return {"name": name, **ctx}
