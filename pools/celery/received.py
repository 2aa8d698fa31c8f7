"""Messages a worker holds: their claims, keyed by task id from the moment they arrive.

Celery's main process receives every message (``task_received``) before it hands it to a
pool process; it may hold it a long time first: an ETA/countdown not yet due, Celery's
own ``rate_limit`` token bucket, a prefetched message waiting for a busy pool process.
This module records the claim (``pools_claim`` header) of each such message by task id
and, in one daemon thread of the main process, renews the lease of every claim whose
message has not been started yet, so a held message never loses its slots to a lapse.
Once a pool process accepts the message, that process starts the claim and its own
lease keeper (:mod:`pools.celery.keeper`) renews it; a lost worker stops both renewals
and the lease lapses as before.

A body stuck in a C call that holds the GIL runs no Python, so its keeper renews nothing.
When the task has a hard time limit, billiard (in this process) ends such a body at the
limit; until then this thread also renews the claim of an accepted message whose pool
process is alive, but only when the lease is near its end (a healthy keeper keeps more
than that): the entry then fails at the limit instead of lapsing and running a second
time beside the stuck body. The pool process's own fencing is unchanged: its watchdog
still stops a body whose keeper could not confirm a renewal by the fence time.

The main process also settles what only it sees, by task id (never through
``sender.request``, which Celery fills before ``task_failure`` only since 5.7):

* ``WorkerLostError`` (a pool process died under the body: SIGKILL, OOM killer,
  SIGTERM/SIGQUIT): the entry goes back in line at once and runs again;
* ``TimeLimitExceeded`` (the hard time limit): the entry ends ``failed``, as Celery
  fails the task, once the pool process is gone (billiard sends TERM, then KILL, right
  after reporting it): it does not run again.

Each change is a compare-and-set on the fencing token, so an end reported twice (the
pool process and the main process, or Celery 5.7's second ``task_failure``) settles once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from celery import signals
from celery.exceptions import TimeLimitExceeded, WorkerLostError
from celery.worker import state as worker_state
from django.db import DatabaseError, connection

from pools import conf
from pools.celery.messages import claim_of
from pools.core import admission, leases

logger = logging.getLogger("pools.celery.received")

#: How long a finished message's claim is kept for a late ``task_failure`` handler.
FORGET_AFTER_SECONDS = 10.0
#: Longest the main process waits for a timed-out pool process to exit before it fails
#: the entry anyway (billiard SIGKILLs it 0.1 s after the TERM).
EXIT_WAIT_SECONDS = 10.0


@dataclass(kw_only=True)
class Received:
    """A claimed message this worker received and has not finished."""

    task_id: str
    entry_id: int
    token: int
    #: Celery's ``Request`` (its ``time_start`` is set once a pool process accepts it).
    request: Any
    #: When a pass first saw it finished (``time.monotonic()``), else None.
    finished_seen: float | None = None
    #: True once this process renewed it while a pool process ran it (logged once).
    kept: bool = False


@dataclass(kw_only=True)
class _Failing:
    """A hard-time-limited attempt to fail once its pool process ``pid`` has exited."""

    entry_id: int
    token: int
    pid: int | None
    since: float


_lock = threading.Lock()
_received: dict[str, Received] = {}
_failing: list[_Failing] = []
_wake = threading.Event()
_thread: threading.Thread | None = None
_pid = 0


def claim_for(task_id: str | None, request: Any = None) -> tuple[int, int] | None:
    """The ``(entry id, token)`` of a received message, else the one ``request`` carries."""
    if task_id:
        with _lock:
            found = _received.get(task_id)
        if found is not None:
            return found.entry_id, found.token
    return claim_of(headers_of(request)) if request is not None else None


def headers_of(request: Any) -> Any:
    """What carries a request's headers: its broker message if it has one (main process)."""
    message = getattr(request, "message", None)
    return message if message is not None else request


def waiting() -> list[Received]:
    """Received claimed messages no pool process has accepted yet (reserved, ETA, rated)."""
    with _lock:
        held = list(_received.values())
    return [r for r in held if not _accepted(r.request)]


def forget(task_id: str) -> None:
    """Stop tracking a message (it was revoked, or handed back to the broker)."""
    with _lock:
        _received.pop(task_id, None)


def _accepted(request: Any) -> bool:
    return getattr(request, "time_start", None) is not None


@signals.task_received.connect(dispatch_uid="pools.celery.received.track")
def _track(sender: Any = None, request: Any = None, **kwargs: Any) -> None:
    """Record the claim of a message the moment the worker receives it."""
    parsed = claim_of(headers_of(request))
    if parsed is None or request is None or not getattr(request, "id", None):
        return
    with _lock:
        _received[request.id] = Received(
            task_id=request.id, entry_id=parsed[0], token=parsed[1], request=request
        )
    _ensure_thread()


@signals.task_failure.connect(dispatch_uid="pools.celery.received.ended")
def _ended_in_main(
    sender: Any = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    **kwargs: Any,
) -> None:
    """A lost pool process requeues its entry; a hard time limit fails it (main process).

    Celery's main process reports both; with ``task_reject_on_worker_lost`` it hands the
    message back to the broker instead and sends no signal (the lease lapses then, as for
    a lost node).
    """
    if not isinstance(exception, WorkerLostError | TimeLimitExceeded):
        return
    parsed = claim_for(task_id, getattr(sender, "request", None))
    if parsed is None:
        return
    with _lock:
        found = _received.pop(task_id or "", None)
        failing = any((f.entry_id, f.token) == parsed for f in _failing)
    entry_id, token = parsed
    if failing:
        return  # timed out: the pool process's death that follows is no reason to rerun
    if isinstance(exception, TimeLimitExceeded):
        pid = getattr(found.request, "worker_pid", None) if found is not None else None
        try:
            # Its keeper may not have renewed (a C call holds the GIL): keep the sweep from
            # requeueing it while billiard stops the process.
            leases.renew(entry_id, token)
        except DatabaseError:
            _close()
        with _lock:
            _failing.append(
                _Failing(entry_id=entry_id, token=token, pid=pid, since=time.monotonic())
            )
        logger.warning(
            "Entry %s failed: hard time limit exceeded; its slots return once the pool "
            "process has exited",
            entry_id,
        )
        _ensure_thread()
        _wake.set()
        return
    try:
        if admission.requeue(entry_id, token, reason="worker lost"):
            logger.warning("Entry %s requeued: its worker process was lost", entry_id)
    except Exception:
        logger.exception("Could not requeue lost entry %s; its lease will lapse", entry_id)


# --------------------------------------------------------------------------- thread


def _ensure_thread() -> None:
    global _thread, _pid
    # A forked pool process inherits the module but not the thread (and needs none).
    if _thread is not None and _thread.is_alive() and _pid == os.getpid():
        return
    _pid = os.getpid()
    _thread = threading.Thread(target=_run, name="pools-received-renewer", daemon=True)
    _thread.start()


def _run() -> None:
    while True:
        with _lock:
            failing = bool(_failing)
        interval = conf.get().heartbeat_seconds
        # A timed-out pool process exits within ~0.1 s: look for it often meanwhile.
        _wake.wait(min(interval, 0.1) if failing else interval)
        _wake.clear()
        try:
            fail_exited()
            renew_waiting()
        except Exception:  # the thread must never die
            logger.exception("renewing received messages failed")
        with _lock:
            idle = not _received and not _failing
        if idle:  # an idle worker holds no database connection
            _close()


def renew_waiting() -> None:
    """One pass: renew every received claim not yet accepted, and the running ones a hard
    time limit will end whose lease is near its end; forget the finished ones."""
    active = set(worker_state.active_requests)
    with _lock:
        held = list(_received.values())
    now = time.monotonic()
    for r in held:
        if _accepted(r.request):
            if r.request in active:
                r.finished_seen = None  # (accepted is set a moment before active)
                if _until_hard_limit(r.request):
                    _renew_if_ending(r)  # its pool process may be stuck in a C call
                continue  # its pool process renews it
            # Finished. Celery marks it ready just before it sends task_failure: keep the
            # claim a while for that handler, then forget it (its pool process settled it).
            if r.finished_seen is None:
                r.finished_seen = now
            elif now - r.finished_seen > FORGET_AFTER_SECONDS:
                forget(r.task_id)
            continue
        try:
            until = leases.renew(r.entry_id, r.token)
        except DatabaseError:
            _close()
            continue  # the next pass tries again; the lease lapses if it never lands
        if until is None:
            # Requeued, cancelled or settled elsewhere: the pool process will skip it.
            forget(r.task_id)


def hard_time_limit(request: Any) -> float | None:
    """The hard time limit (seconds) billiard enforces on an accepted request, else None.

    billiard's job holds the limit it applies (the request's ``time_limit``, the task's,
    or the worker's ``task_time_limit``/``--time-limit``); without it, the same order is
    read from the request, the task and the app.
    """
    ref = getattr(request, "_apply_result", None)
    job = ref() if callable(ref) else None
    limits = getattr(request, "time_limits", None) or (None, None)
    task = getattr(request, "task", None)
    app = getattr(task, "app", None)
    for limit in (
        getattr(job, "_timeout", None),
        limits[0],
        getattr(task, "time_limit", None),
        getattr(getattr(app, "conf", None), "task_time_limit", None),
    ):
        if isinstance(limit, int | float) and limit > 0:
            return float(limit)
    return None


def _until_hard_limit(request: Any, now: float | None = None) -> bool:
    """True while a hard time limit (+ the exit wait) is still ahead of a request that runs
    in another process that is alive: the span billiard may need to end a stuck body."""
    limit = hard_time_limit(request)
    started = getattr(request, "time_start", None)  # wall clock, set at acceptance
    pid = getattr(request, "worker_pid", None)
    if limit is None or not started or not pid or pid == os.getpid():
        return False  # a body in this process is renewed by this process's own keeper
    now = time.time() if now is None else now
    return now < started + limit + EXIT_WAIT_SECONDS and _alive(pid)


def renew_within() -> float:
    """How little of a lease is left when the main process renews a running claim.

    A healthy keeper renews every heartbeat, so at least ``LEASE - HEARTBEAT`` is left
    (two thirds by default): half the lease means one renewal was missed. A pass runs every
    heartbeat, so the lease still has ``within - HEARTBEAT`` left when it is renewed.
    """
    settings = conf.get()
    lease = settings.LEASE_SECONDS
    return min(lease, max(lease / 2, 1.5 * settings.heartbeat_seconds))


def _renew_if_ending(r: Received) -> None:
    try:
        until = leases.renew_if_ending(r.entry_id, r.token, within=renew_within())
    except DatabaseError:
        _close()
        return  # the next pass tries again
    if until is not None and not r.kept:
        r.kept = True
        logger.warning(
            "Entry %s: its pool process renewed nothing (stuck in a C call?); the worker's "
            "main process keeps its lease until the hard time limit ends the body",
            r.entry_id,
        )


def fail_exited() -> None:
    """Fail the hard-time-limited entries whose pool process has exited."""
    now = time.monotonic()
    with _lock:
        due = [f for f in _failing if not _alive(f.pid) or now - f.since > EXIT_WAIT_SECONDS]
        for f in due:
            _failing.remove(f)
    for f in due:
        try:
            admission.settle(f.entry_id, f.token, "failed", reason="hard time limit exceeded")
        except Exception:
            logger.exception("Could not fail timed-out entry %s; its lease will lapse", f.entry_id)


def _alive(pid: int | None) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped counts as gone)."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _close() -> None:
    try:
        connection.close()
    except Exception:
        logger.debug("closing the renewer's connection failed", exc_info=True)
