"""Worker side of ``raise pools.Backoff(seconds)``: the attempt ends without failing.

Called by :func:`pools.celery.worker.run_gated` when a pooled body raises
:class:`pools.Backoff`. The entry goes back to its place in line and its pools pause
(:func:`pools.core.backoffs.back_off`); the delivery then ends with Celery's ``Ignore``, so
no result is stored (the ``AsyncResult`` stays pending) and ``task_postrun`` settles
nothing. The entry is admitted and published again, with the same task id, once the pause
has ended. Past the task's limit (``@pooled(max_backoffs=N)``, else
``POOLS["MAX_BACKOFFS"]``) the body's backoff becomes :class:`BackoffLimitExceeded`: the
task fails as with Celery's ``MaxRetriesExceededError`` and the entry settles ``failed``.
"""

from __future__ import annotations

import logging
from typing import Any

from pools import conf, specs
from pools.celery.keeper import keeper
from pools.core import backoffs
from pools.core.leases import Claim
from pools.exceptions import Backoff, BackoffLimitExceeded

logger = logging.getLogger("pools.celery.backoff")


def limit_of(task: Any) -> int:
    """The backoffs ``task`` may make: its ``@pooled(max_backoffs=N)``, else the setting."""
    spec = specs.spec_of(task)
    if spec is not None and spec.max_backoffs is not None:
        return spec.max_backoffs
    return conf.get().MAX_BACKOFFS


def back_off(task: Any, request: Any, claim: Claim, exc: Backoff) -> None:
    """Put the claim's entry back in line and pause its pools, or raise
    :class:`BackoffLimitExceeded` (the caller then lets Celery record the failure)."""
    limit = limit_of(task)
    try:
        done = backoffs.back_off(
            claim.entry_id, claim.token, exc.seconds, pools=exc.pools, limit=limit
        )
    except Exception:
        # Pool state unavailable: stop renewing; the lease lapses and the sweep puts the
        # entry back in line (it runs again, without the pause).
        keeper.release(claim.entry_id)
        logger.exception(
            "%s[%s]: could not back off (entry %s); it runs again once its lease lapses",
            task.name,
            request.id,
            claim.entry_id,
        )
        return
    if done.exceeded:
        raise BackoffLimitExceeded(task.name, limit) from exc
    keeper.release(claim.entry_id)
    if not done.requeued:
        logger.warning(
            "%s[%s]: backed off, but its claim on entry %s was already lost",
            task.name,
            request.id,
            claim.entry_id,
        )
