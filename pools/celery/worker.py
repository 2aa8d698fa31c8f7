"""Worker side of the gate: a pooled body runs only under a valid claim.

* A message with a ``pools_claim`` header is started by compare-and-set on its
  fencing token (``admitted`` -> ``running``); a stale or repeated delivery is
  skipped (``Ignore``) and logged.
* A message without a claim (``send_task`` from a process that bypassed the gate)
  is put in line as a new entry and not executed.
* The claim is settled in ``task_postrun``, i.e. after the result is stored and
  callbacks are dispatched; the settling worker admits the next entries itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from billiard import common as billiard_common
from celery import current_task, signals
from celery.exceptions import Ignore
from celery.worker import state as worker_state
from django.db import connection, connections

from pools import checks, conf
from pools.celery import backoff, default_pool, messages, received, results
from pools.celery.keeper import body_running, keeper
from pools.celery.messages import claim_of
from pools.core import admission, budgets, leases, locking, nodes, starts
from pools.core.engine import engine
from pools.core.leases import Claim
from pools.exceptions import Backoff, LeaseLost, PoolUnavailable
from pools.pg import fastpath
from pools.states import Origin

#: Longest a worker retries starting a claim while pool state is unavailable.
START_RETRY_SECONDS = 10.0

logger = logging.getLogger("pools.celery.worker")

_local = threading.local()
_claims: dict[str, Claim] = {}
_claims_lock = threading.Lock()
#: When the body of a delivery whose run has a budget started (``time.monotonic()``).
_timed: dict[str, float] = {}
#: Deliveries whose body was cut off by a terminate signal to this (pool) process.
_exiting: set[str] = set()
#: Deliveries whose body backed off (:mod:`pools.celery.backoff`): their entry waits again.
_backed_off: set[str] = set()

#: Celery task states -> entry outcome.
OUTCOMES = {
    "SUCCESS": "succeeded",
    "FAILURE": "failed",
    "RETRY": "retried",
    "IGNORED": "succeeded",
    "REJECTED": "failed",
    "REVOKED": "cancelled",
}


def current_claim() -> Claim | None:
    """The claim held by the pooled task body running in this thread, if any."""
    claim: Claim | None = getattr(_local, "claim", None)
    return claim


def budget_of(request: Any) -> str:
    """The run id a delivery's ``pools_budget`` header names (its run has a budget), or ""."""
    raw = (getattr(request, "headers", None) or {}).get(messages.BUDGET_HEADER) or getattr(
        request, messages.BUDGET_HEADER, None
    )
    return raw if isinstance(raw, str) else ""


def _charge_seconds(claim: Claim, started: float) -> None:
    """Charge the attempt's task seconds to its run (before it settles: still its token)."""
    seconds = time.monotonic() - started
    try:
        budgets.charge(claim.entry_id, claim.token, seconds=seconds)
    except LeaseLost:
        logger.info("Entry %s: lease lost, its task seconds are not charged", claim.entry_id)
    except Exception:
        logger.exception("Could not charge the task seconds of entry %s", claim.entry_id)


def run_gated(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``fn`` if the current delivery holds a valid claim (called by the wrapped ``run``)."""
    task = current_task
    request = getattr(task, "request", None) if task is not None else None
    if request is None or request.called_directly or request.is_eager:
        # A direct call or eager mode: the caller asked to run it here and now.
        return fn(*args, **kwargs)
    parsed = claim_of(request)
    if parsed is None:
        if not _needs_claim(task, request):
            return fn(*args, **kwargs)
        _enqueue_unclaimed(task, request)
        raise Ignore()
    entry_id, token = parsed
    locking.drop_broken_connection()
    claim = start_claim(
        entry_id,
        token,
        worker=request.hostname or "",
        what=f"{task.name}[{request.id}]",
        rated=messages.rated_of(request),
    )
    if isinstance(claim, starts.Postponed):
        # Its place in a rated pool's window of starts comes later: the entry is back in
        # line and is admitted (and delivered) again then; this delivery does not run.
        logger.info(
            "%s[%s]: its pool's rate has no room for this start for %.3f s; entry %s is "
            "back in line until then",
            task.name,
            request.id,
            claim.seconds,
            entry_id,
        )
        raise Ignore()
    if claim is None:
        logger.warning(
            "Skipping delivery of %s[%s]: claim %s:%s is stale or already used",
            task.name,
            request.id,
            entry_id,
            token,
        )
        leases.record_skipped(entry_id, request.id or "", token, "stale or repeated claim")
        raise Ignore()
    keeper.hold(claim)
    with _claims_lock:
        _claims[request.id] = claim
        if budget_of(request):
            _timed[request.id] = time.monotonic()
    _local.claim = claim
    try:
        with body_running():
            return fn(*args, **kwargs)
    except Backoff as exc:
        backoff.back_off(task, request, claim, exc)
        with _claims_lock:
            _backed_off.add(request.id)
        raise Ignore() from None
    except LeaseLost:
        if keeper.is_lost(claim.entry_id):
            # Our slots may already be re-issued: store no result; the entry runs again.
            logger.warning("%s[%s] stopped: lease lost", task.name, request.id)
            raise Ignore() from None
        raise
    except SystemExit as exc:
        if _terminated_by_signal(exc):
            # The process is exiting and the body has stopped. Celery's main process
            # reports it (WorkerLostError, or TimeLimitExceeded when the hard time limit
            # sent the signal) and settles the entry from what it recorded at receipt
            # (pools.celery.received): requeued, or failed.
            with _claims_lock:
                _exiting.add(request.id)
        raise
    finally:
        _local.claim = None


def _terminated_by_signal(exc: SystemExit) -> bool:
    """True if billiard's terminate handler raised ``exc`` (SIGTERM/SIGQUIT to a pool process).

    billiard turns those signals into ``sys.exit(-(256 - signum))`` inside the body; a
    body's own ``sys.exit()`` is not one of them and settles as before.
    """
    fired = getattr(billiard_common, "terminate_handler_fired", None)
    if fired is not None:
        return bool(fired())
    return isinstance(exc.code, int) and exc.code < 0


def start_claim(
    entry_id: int, token: int, *, worker: str, what: str, rated: bool = False
) -> Claim | starts.Postponed | None:
    """``leases.start`` (``leases.start_rated`` for a delivery admitted in a pool with a
    rate), retried through a short database outage (a PostgreSQL restart).

    If pool state stays unavailable for half a lease (10 s at most), the delivery is dropped
    without running and without a result (``Ignore``): the entry is still admitted, its
    lease lapses and it is admitted and published again (at-least-once). Letting
    :class:`PoolUnavailable` escape instead would store a FAILURE for a task that will run
    later, and fire its error callbacks.
    """
    deadline = time.monotonic() + min(conf.get().LEASE_SECONDS / 2, START_RETRY_SECONDS)
    delay = 0.1
    while True:
        try:
            if rated:
                return leases.start_rated(entry_id, token, worker=worker)
            return leases.start(entry_id, token, worker=worker)
        except PoolUnavailable as exc:
            connection.close()  # the next try reconnects
            if time.monotonic() + delay > deadline:
                logger.warning(
                    "%s: could not start claim %s:%s (%s); not running this delivery, the "
                    "entry runs again once its lease lapses",
                    what,
                    entry_id,
                    token,
                    exc,
                )
                raise Ignore() from exc
            time.sleep(delay)
            delay = min(delay * 2, 1.0)


def _needs_claim(task: Any, request: Any) -> bool:
    """False for a task gated only for the default pool, delivered from another queue."""
    if task.name not in default_pool.DEFAULT_GATED:
        return True
    info = getattr(request, "delivery_info", None) or {}
    return default_pool.is_default_queue(str(info.get("routing_key") or ""))


def _enqueue_unclaimed(task: Any, request: Any) -> None:
    """Turn a delivery that arrived without a claim into a waiting entry."""
    logger.warning(
        "%s[%s] arrived without a pool claim (sent around the gate, e.g. by send_task from a "
        "process that does not import the task); putting it in line instead of running it",
        task.name,
        request.id,
    )
    options = request.as_execution_options()
    options.pop("task_id", None)
    options[messages.ORIGIN_OPTION] = Origin.UNGATED
    task.app.send_task(task.name, request.args, request.kwargs, task_id=request.id, **options)


@signals.task_postrun.connect(dispatch_uid="pools.celery.worker.settle")
def _settle_after_run(
    sender: Any = None,
    task_id: str | None = None,
    state: str | None = None,
    retval: Any = None,
    **kwargs: Any,
) -> None:
    """Release the claim once the attempt has settled (result stored, callbacks sent).

    A body that raised ``Reject(requeue=True)`` asked Celery to deliver it again: its
    claim stays valid for that redelivery (:func:`pools.core.leases.redeliver`), which then
    runs as in plain Celery, ``delivery_info["redelivered"]`` and all.
    """
    if task_id is None:
        return
    with _claims_lock:
        claim = _claims.pop(task_id, None)
        started = _timed.pop(task_id, None)
        exiting = task_id in _exiting
        _exiting.discard(task_id)
        backed_off = task_id in _backed_off
        _backed_off.discard(task_id)
    if claim is None:
        return
    collapsed = getattr(getattr(sender, "request", None), messages.DEBOUNCED_HEADER, None)
    if collapsed:
        try:  # before the settle: a caller that waits on an earlier call sees the result now
            results.mirror(task_id, collapsed, state, retval)
        except Exception:
            logger.exception("%s: could not store its result under the calls it collapsed", task_id)
    lost, expires_at = keeper.release(claim.entry_id)
    if backed_off:  # its entry is back in line: nothing to settle (and no result stored)
        return
    if exiting:
        logger.warning(
            "%s: its pool process is exiting (signal) under the body of entry %s; the main "
            "process settles it",
            task_id,
            claim.entry_id,
        )
        return
    locking.drop_broken_connection()
    if started is not None and not lost:
        _charge_seconds(claim, started)
    try:
        if lost:
            admission.requeue(claim.entry_id, claim.token, reason="lease lost")
            return
        if state == "REJECTED" and getattr(retval, "requeue", False):
            leases.redeliver(claim.entry_id, claim.token)
            return
        outcome = OUTCOMES.get(state or "", "failed")
        try:
            settled = admission.settle(claim.entry_id, claim.token, outcome, live_lease=True)
        except Exception:
            # The keeper logs "pool <name>: retry settlement deferred" once per outage.
            logger.debug("Could not settle entry %s now", claim.entry_id, exc_info=True)
            keeper.defer_settle(claim, outcome, expires_at or claim.lease_expires_at)
            return
        job = getattr(getattr(sender, "request", None), messages.JOB_HEADER, None)
        if settled and outcome == "succeeded" and job:
            # A success of the job supersedes its queued retries (docs/howto/job-policies.md).
            admission.supersede_retries(str(job), reason=f"job {job} succeeded ({task_id})")
    except Exception:
        logger.exception("Could not release entry %s; its lease will lapse", claim.entry_id)


@signals.task_revoked.connect(dispatch_uid="pools.celery.worker.revoked")
def _release_revoked(sender: Any = None, request: Any = None, **kwargs: Any) -> None:
    """A revoked/terminated/expired delivery (worker main process) gives its slots back."""
    task_id = getattr(request, "id", None)
    parsed = received.claim_for(task_id, request)
    if parsed is None:
        return
    if task_id:
        received.forget(task_id)
    try:
        admission.settle(parsed[0], parsed[1], "cancelled", reason="revoked")
    except Exception:
        logger.exception("Could not release revoked entry %s; its lease will lapse", parsed[0])


class _NodeHeartbeat(threading.Thread):
    def __init__(self, hostname: str) -> None:
        super().__init__(name="pools-node-heartbeat", daemon=True)
        self.hostname = hostname
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                if nodes.beat(self.hostname):
                    # Joined (or back): entries pinned to this worker may be admitted now.
                    pinned = nodes.pinned_pools(self.hostname)
                    if pinned:
                        admission.admit(pinned)
            except Exception:
                logger.warning("worker heartbeat for %s failed", self.hostname, exc_info=True)
                connection.close()
            self.stopped.wait(conf.get().heartbeat_seconds)


_heartbeat: _NodeHeartbeat | None = None


@signals.worker_process_init.connect(dispatch_uid="pools.celery.worker.own_connection")
@signals.worker_init.connect(dispatch_uid="pools.celery.worker.own_connection_main")
def _use_own_connection(**kwargs: Any) -> None:
    """Start, settle and renew run on pools' own prepared connection in workers.

    Celery's Django fixup closes Django's connections around every task unless
    ``CELERY_DB_REUSE_MAX`` is set; it does not close this one (see :mod:`pools.pg.fastpath`).
    Set in the main process too (``-P solo``/``threads``, revocations); a forked pool
    process never uses its parent's connection.
    """
    fastpath.use_own_connection()


@signals.worker_process_init.connect(dispatch_uid="pools.celery.worker.socket_bounds")
@signals.worker_init.connect(dispatch_uid="pools.celery.worker.socket_bounds_main")
def _bound_database_sockets(**kwargs: Any) -> None:
    """Give Django's PostgreSQL connections in workers client-side socket bounds.

    Connect timeout, TCP keepalives and ``tcp_user_timeout``
    (:func:`pools.core.locking.client_bounds`), for every key the user did not set in
    ``OPTIONS``: renewals, settles, sweeps and task bodies on a silently partitioned
    network then fail within a bound instead of hanging. Connections opened afterwards
    get them (Celery's Django fix-up closes the parent's at process start).
    """
    for alias in connections:
        settings_dict = connections.settings[alias]
        if settings_dict.get("ENGINE", "").endswith("postgresql"):
            settings_dict["OPTIONS"] = locking.bound_client_options(
                settings_dict.get("OPTIONS") or {}
            )


@signals.worker_init.connect(dispatch_uid="pools.celery.worker.db_reuse")
def _warn_about_reconnects(sender: Any = None, **kwargs: Any) -> None:
    """Celery's Django fixup closes DB connections around every task unless told otherwise."""
    app = getattr(sender, "app", None)
    if app is not None and not app.conf.get("db_reuse_max") and not engine().own_worker_connection:
        logger.warning(
            "Celery closes the database connection before and after every task "
            "(CELERY_DB_REUSE_MAX is not set), so every pooled task reconnects to start and "
            "settle its claim, a few milliseconds each on PostgreSQL. Set "
            "CELERY_DB_REUSE_MAX = 1000 in the Django settings to keep worker connections."
        )


@signals.worker_init.connect(dispatch_uid="pools.celery.worker.schema")
def _refuse_to_hide_an_old_schema(sender: Any = None, **kwargs: Any) -> None:
    """One line at start when the database lacks this release's migrations."""
    pending = checks.pending_migrations()
    if pending:
        logger.error(checks.schema_behind_message(pending))


@signals.worker_ready.connect(dispatch_uid="pools.celery.worker.ready")
def _start_node_heartbeat(sender: Any = None, **kwargs: Any) -> None:
    """Record this worker as live while it runs (node affinity, UI)."""
    global _heartbeat
    hostname = getattr(sender, "hostname", None)
    if hostname and _heartbeat is None:
        _heartbeat = _NodeHeartbeat(hostname)
        _heartbeat.start()


@signals.worker_shutting_down.connect(dispatch_uid="pools.celery.worker.release_reserved")
def _release_reserved(sender: Any = None, **kwargs: Any) -> None:
    """Give back the slots of deliveries this worker received but will not run.

    A worker holds admitted messages it has not started: prefetched behind a busy pool
    process, an ETA not yet due, Celery's ``rate_limit`` bucket. On shutdown the broker
    gets them back, but their entries would keep their slots until another worker starts
    them or their lease lapses (the main process renews them while it holds them).
    Requeueing them when the shutdown begins (warm or cold; the main process, which runs
    no task bodies) puts them back in line at once; the returned messages are then stale
    and skipped, and one that starts anyway during a warm shutdown finds its token stale.
    """
    active = {r.id for r in list(worker_state.active_requests)}
    claims = {r.task_id: (r.entry_id, r.token) for r in received.waiting()}
    for request in list(worker_state.reserved_requests):
        parsed = claim_of(received.headers_of(request))
        if parsed is not None and request.id not in active:
            claims.setdefault(request.id, parsed)
    for task_id, (entry_id, token) in claims.items():
        if task_id in active:
            continue
        received.forget(task_id)
        try:
            admission.requeue(entry_id, token, reason="worker shutdown")
        except Exception:
            logger.warning("Could not requeue entry %s at shutdown; its lease will lapse", entry_id)


@signals.worker_shutdown.connect(dispatch_uid="pools.celery.worker.shutdown")
def _stop_node_heartbeat(sender: Any = None, **kwargs: Any) -> None:
    if _heartbeat is None:
        return
    _heartbeat.stopped.set()
    try:
        nodes.gone(_heartbeat.hostname)
    except Exception:
        logger.debug("could not remove node row", exc_info=True)
