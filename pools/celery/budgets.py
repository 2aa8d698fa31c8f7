"""Celery side of run budgets: ``pools.charge()`` (``pools.limit_run()`` is in :mod:`pools.celery.caps`)."""

from __future__ import annotations

import logging

from pools.celery import worker
from pools.core import budgets
from pools.core.budgets import Charged

logger = logging.getLogger("pools.celery.budgets")


def charge(*, cost: float = 0, tokens: int = 0) -> Charged | None:
    """Charge ``cost`` and ``tokens`` to the run of the pooled task running in this thread.

    Charges are durable, add up per attempt, and count once per attempt. Returns the run's
    spend after the charge, or ``None`` when nothing is charged: the run has no budget, or
    the caller is not the body of a pooled task (a direct or eager call).
    Raises :class:`~pools.exceptions.LeaseLost` when this attempt's lease was lost and the
    entry admitted again (the new attempt charges for itself).
    """
    claim = worker.current_claim()
    if claim is None:
        logger.debug("pools.charge() outside a pooled task body: nothing charged")
        return None
    return budgets.charge(claim.entry_id, claim.token, cost=cost, tokens=tokens)
