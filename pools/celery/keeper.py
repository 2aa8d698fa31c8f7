"""The lease keeper: one daemon thread per worker process that renews running claims.

Every ``heartbeat_seconds`` (a third of the lease by default) it renews each claim
held in this process with its fencing token. When a renewal is refused (the entry
was re-queued, its token moved on) or cannot be confirmed before the lease would
lapse (database unreachable), the claim is *lost*: the task body is interrupted
with :class:`~pools.exceptions.LeaseLost` so a partitioned worker stops before
its slots can be re-issued.

**Fencing by the local clock.** A renewal call can hang (a silent network partition:
no RST, no FIN), so the fence does not wait for it to fail. Each claim carries a
*fence time* on this process's monotonic clock: ``LEASE_SECONDS - FENCE_MARGIN_SECONDS``
after the moment the last *confirmed* renewal (or the start) was sent. A second
daemon thread, the watchdog, never does I/O: every :data:`WATCHDOG_SECONDS` it
interrupts every body whose fence time has passed, whether or not the renewal
thread is stuck in a call. The sweep re-admits a claim only ``REQUEUE_GRACE_SECONDS``
after its lease end (see the timing rule in ``docs/concepts/leases.md``).

How the body is interrupted depends on where it runs:

* main thread of its process (prefork children, ``solo``): a ``SIGUSR2`` handler
  raises ``LeaseLost``; a signal also breaks out of ``time.sleep`` and blocking I/O;
* any other thread (``threads`` pool): ``PyThreadState_SetAsyncExc`` raises it at
  the next Python bytecode (not inside a long C call). CPython only.
* gevent/eventlet: not interrupted (documented); the fencing token still fences writes.

Completions that could not be written (database down) are kept and retried on
each pass until they land or the lease would have lapsed.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import DatabaseError, connection
from django.utils import timezone

from pools import conf
from pools.core import admission, leases
from pools.core.leases import Claim
from pools.exceptions import LeaseLost

logger = logging.getLogger("pools.celery.keeper")

INTERRUPT_SIGNAL = signal.SIGUSR2
#: How often the watchdog compares fence times with the monotonic clock.
WATCHDOG_SECONDS = 0.1


@dataclass(kw_only=True)
class _Held:
    claim: Claim
    thread_id: int
    expires_at: datetime
    #: ``time.monotonic()`` after which the body is interrupted unless a renewal is
    #: confirmed first (lease end minus the fence margin, on this process's clock).
    fence_at: float
    lost: bool = False


def _fence_at(sent: float, expires_at: datetime | None = None) -> float:
    """The fence time of a lease confirmed by a call sent at ``sent`` (monotonic).

    ``expires_at`` (a start's lease, which may have been set at admission by another
    process) is turned into this process's monotonic clock; a renewal's lease is
    ``LEASE_SECONDS`` from just before it was sent, so its fence is counted from ``sent``.
    """
    settings = conf.get()
    lease = settings.LEASE_SECONDS
    if expires_at is not None:
        lease = min(lease, (expires_at - timezone.now()).total_seconds())
    return sent + lease - settings.fence_margin_seconds


@dataclass(kw_only=True)
class _PendingSettle:
    claim: Claim
    outcome: str
    expires_at: datetime
    attempts: int = field(default=0)


class LeaseKeeper:
    """Renews the claims of this process; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, _Held] = {}
        self._pending: list[_PendingSettle] = []
        #: Pools with a deferred completion in this outage (logged once each).
        self._deferred_pools: set[str] = set()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        self._pid = 0
        self._stopping = False
        #: Testing hook: when set, renewals fail as if the database were unreachable.
        self.partitioned = False

    # ------------------------------------------------------------------ task side
    def hold(self, claim: Claim) -> None:
        """Start renewing ``claim`` for the body running in the calling thread."""
        if threading.current_thread() is threading.main_thread():
            _install_signal_handler()
        fence_at = _fence_at(time.monotonic(), claim.lease_expires_at)
        with self._lock:
            self._held[claim.entry_id] = _Held(
                claim=claim,
                thread_id=threading.get_ident(),
                expires_at=claim.lease_expires_at,
                fence_at=fence_at,
            )
        self._ensure_thread()

    def release(self, entry_id: int) -> tuple[bool, datetime | None]:
        """Stop renewing; returns (lost meanwhile?, when the lease lapses)."""
        with self._lock:
            held = self._held.pop(entry_id, None)
        if held is None:
            return False, None
        return held.lost, held.expires_at

    def is_lost(self, entry_id: int) -> bool:
        """True if the claim of ``entry_id`` was lost."""
        with self._lock:
            held = self._held.get(entry_id)
            return bool(held and held.lost)

    def defer_settle(self, claim: Claim, outcome: str, expires_at: datetime) -> None:
        """Keep a completion the worker could not write; retried on every pass.

        Logs ``pool <name>: retry settlement deferred`` once per pool and outage. Written
        before ``expires_at`` (the lease) it counts; after it, the entry is back in line
        and runs again (at-least-once), so the completion is dropped.
        """
        with self._lock:
            self._pending.append(
                _PendingSettle(claim=claim, outcome=outcome, expires_at=expires_at)
            )
            new = sorted(set(claim.demand) - self._deferred_pools)
            self._deferred_pools.update(new)
        for pool in new:
            logger.warning("pool %s: retry settlement deferred", pool)
        self._ensure_thread()
        self._wake.set()

    # ------------------------------------------------------------------ keeper thread
    def _ensure_thread(self) -> None:
        """Start the renewal thread and the watchdog if they are not running here."""
        pid = os.getpid()
        if self._pid != pid:  # after a fork (prefork children) the parent's threads are gone
            self._pid, self._thread, self._watchdog = pid, None, None
        self._stopping = False
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._run, name="pools-lease-keeper", daemon=True
            )
            self._thread.start()
        if self._watchdog is None or not self._watchdog.is_alive():
            self._watchdog = threading.Thread(
                target=self._watch, name="pools-lease-watchdog", daemon=True
            )
            self._watchdog.start()

    def _watch(self) -> None:
        """The watchdog: fence by the local clock. No I/O here, ever (not even logging
        before the interrupt is sent): it must run while the renewal thread hangs."""
        while not self._stopping:
            time.sleep(WATCHDOG_SECONDS)
            self.fence_overdue()

    def fence_overdue(self, now: float | None = None) -> int:
        """Interrupt every body whose renewal was not confirmed by its fence time."""
        now = time.monotonic() if now is None else now
        with self._lock:
            overdue = [h for h in self._held.values() if not h.lost and now >= h.fence_at]
        for h in overdue:
            late = now - h.fence_at
            self._lose(
                h,
                "no renewal confirmed by the fence time (lease end minus FENCE_MARGIN_SECONDS, "
                f"{late:.2f}s ago) on this worker's clock: the database is unreachable or slow",
            )
        return len(overdue)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the keeper thread (tests, worker shutdown); it closes its connection."""
        self._stopping = True
        self._wake.set()
        for thread in (self._thread, self._watchdog):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout)
        self._thread = self._watchdog = None

    def _run(self) -> None:
        self._stopping = False
        try:
            while not self._stopping:
                self._wake.wait(conf.get().heartbeat_seconds)
                self._wake.clear()
                if self._stopping:
                    break
                try:
                    self.renew_all()
                    self.retry_settles()
                except Exception:  # the keeper must never die
                    logger.exception("lease keeper pass failed")
                with self._lock:
                    idle = not self._held and not self._pending
                if idle:  # an idle worker holds no database connection
                    _reset_connection()
        finally:
            _reset_connection()

    def renew_all(self) -> None:
        """One renewal pass over every held claim."""
        with self._lock:
            held = [h for h in self._held.values() if not h.lost]
        interval = conf.get().heartbeat_seconds
        for h in held:
            sent = time.monotonic()
            try:
                if self.partitioned:
                    raise DatabaseError("simulated partition (pools.testing)")
                c = h.claim
                until = leases.renew(
                    c.entry_id,
                    c.token,
                    started_at=None if c.start_written else c.started_at,
                    worker=c.worker,
                )
            except DatabaseError as exc:
                _reset_connection()
                # Interrupt while there is still time: the next pass would be too late.
                left = (h.expires_at - timezone.now()).total_seconds()
                if left < interval + 1:
                    self._lose(h, f"renewal failed ({exc}) with {left:.1f}s of lease left")
                continue
            if until is None:
                self._lose(h, "renewal refused: the entry was re-queued or settled elsewhere")
            else:
                with self._lock:
                    h.expires_at = until
                    h.fence_at = max(h.fence_at, _fence_at(sent))

    def retry_settles(self) -> None:
        """Write deferred completions; drop those whose lease has lapsed."""
        with self._lock:
            pending, self._pending = self._pending, []
        keep: list[_PendingSettle] = []
        for p in pending:
            if timezone.now() >= p.expires_at:
                logger.warning(
                    "Completion of entry %s was not written before its lease lapsed; it will run again",
                    p.claim.entry_id,
                )
                continue
            try:
                if self.partitioned:
                    raise DatabaseError("simulated partition (pools.testing)")
                admission.settle(
                    p.claim.entry_id,
                    p.claim.token,
                    p.outcome,
                    live_lease=True,
                    started_at=p.claim.started_at,
                    worker=p.claim.worker,
                )
            except Exception:
                _reset_connection()
                p.attempts += 1
                keep.append(p)
        with self._lock:
            self._pending.extend(keep)
            # The outage is over for pools with nothing left to write: log again next time.
            waiting = {pool for item in self._pending for pool in item.claim.demand}
            self._deferred_pools &= waiting

    def _lose(self, held: _Held, why: str) -> None:
        with self._lock:
            if held.lost or self._held.get(held.claim.entry_id) is not held:
                return  # already lost, or released (settled) while this pass ran
            held.lost = True
        _interrupt(held.thread_id)  # first: logging may block, the fence must not wait
        logger.warning("Lease of entry %s lost: %s; stopping its body", held.claim.entry_id, why)


def _reset_connection() -> None:
    try:
        connection.close()
    except Exception:
        logger.debug("closing the keeper's connection failed", exc_info=True)


#: Threads whose body must be stopped; read by the signal handler.
_doomed: set[int] = set()
#: Threads currently inside a pooled task body: only there may ``LeaseLost`` be raised,
#: never in Celery's own code around it (result encoding, acks).
_in_body: set[int] = set()
_body_lock = threading.Lock()


@contextmanager
def body_running() -> Iterator[None]:
    """Mark the calling thread as running a pooled body (interruptible) for the block."""
    ident = threading.get_ident()
    with _body_lock:
        _in_body.add(ident)
    try:
        yield
    finally:
        with _body_lock:
            _in_body.discard(ident)
            _doomed.discard(ident)
            if ident != threading.main_thread().ident:
                # Cancel an interrupt set but not yet delivered: the body is over.
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), None)


def _interrupt(thread_id: int) -> None:
    with _body_lock:
        if thread_id not in _in_body:
            return  # the body already returned; the claim is requeued at settle time
        if thread_id == threading.main_thread().ident:
            _doomed.add(thread_id)
            os.kill(os.getpid(), INTERRUPT_SIGNAL)
            return
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(thread_id), ctypes.py_object(LeaseLost)
        )


def _on_interrupt_signal(signum: int, frame: Any) -> None:
    ident = threading.get_ident()
    if ident in _doomed and ident in _in_body:
        _doomed.discard(ident)
        raise LeaseLost("the lease of this task's claim was lost; its slots may be re-issued")


_handler_installed = False


def _install_signal_handler() -> None:
    global _handler_installed
    if _handler_installed and signal.getsignal(INTERRUPT_SIGNAL) is _on_interrupt_signal:
        return
    signal.signal(INTERRUPT_SIGNAL, _on_interrupt_signal)
    _handler_installed = True


#: The process-wide keeper.
keeper = LeaseKeeper()


def wait_idle(timeout: float = 5.0) -> None:
    """Testing helper: wait until no deferred completion is pending."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with keeper._lock:
            if not keeper._pending:
                return
        time.sleep(0.05)
