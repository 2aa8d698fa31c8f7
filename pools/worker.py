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
from collections.abc import Callable
from typing import Any

from celery import current_task, signals
from celery.exceptions import Ignore

from pools import leases
from pools.leases import Claim

logger = logging.getLogger("pools.worker")

_local = threading.local()
_claims: dict[str, Claim] = {}
_claims_lock = threading.Lock()

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


def parse_claim(value: Any) -> tuple[int, int] | None:
    """Parse a ``"<entry id>:<token>"`` header; None if absent or malformed."""
    if not isinstance(value, str) or ":" not in value:
        return None
    entry, _, token = value.partition(":")
    try:
        return int(entry), int(token)
    except ValueError:
        return None


def run_gated(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``fn`` if the current delivery holds a valid claim (called by the wrapped ``run``)."""
    task = current_task
    request = getattr(task, "request", None) if task is not None else None
    if request is None or request.called_directly or request.is_eager:
        # A direct call or eager mode: the caller asked to run it here and now.
        return fn(*args, **kwargs)
    raw = (request.headers or {}).get("pools_claim") or getattr(request, "pools_claim", None)
    parsed = parse_claim(raw)
    if parsed is None:
        _enqueue_unclaimed(task, request)
        raise Ignore()
    entry_id, token = parsed
    claim = leases.start(entry_id, token, worker=request.hostname or "")
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
    with _claims_lock:
        _claims[request.id] = claim
    _local.claim = claim
    try:
        return fn(*args, **kwargs)
    finally:
        _local.claim = None


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
    task.app.send_task(task.name, request.args, request.kwargs, task_id=request.id, **options)


@signals.task_postrun.connect(dispatch_uid="pools.worker.settle")
def _settle_after_run(
    sender: Any = None, task_id: str | None = None, state: str | None = None, **kwargs: Any
) -> None:
    """Release the claim once the attempt has settled (result stored, callbacks sent)."""
    if task_id is None:
        return
    with _claims_lock:
        claim = _claims.pop(task_id, None)
    if claim is None:
        return
    from pools import admission

    outcome = OUTCOMES.get(state or "", "failed")
    try:
        admission.settle(claim.entry_id, claim.token, outcome)
    except Exception:
        logger.exception("Could not settle entry %s; its lease will lapse", claim.entry_id)
