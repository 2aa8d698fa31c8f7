"""Celery side of run budgets: ``pools.limit_run()`` and ``pools.charge()``."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from celery.utils import uuid

from pools.celery import worker
from pools.core import budgets
from pools.core.budgets import Charged
from pools.exceptions import PoolConfigurationError
from pools.specs import Budget

logger = logging.getLogger("pools.celery.budgets")


def limit_run(signature: Any, budget: Mapping[str, Any] | Budget, **options: Any) -> Any:
    """Send ``signature`` (a task signature, chain, group or chord) as a run with a budget.

    The run gets an id of its own, its budget row is written (committed) before anything
    is sent, and the signature is applied with ``root_id`` set to that id, so every task it
    starts, and every task those start, belongs to the run. Returns what
    ``signature.apply_async(**options)`` returns. Raises
    :class:`~pools.exceptions.PoolConfigurationError` for a bad budget.
    """
    limits = Budget.from_mapping(budget)
    if "root_id" in options:
        raise PoolConfigurationError(
            f"limit_run() gives the run its own id; do not pass root_id ({options['root_id']!r})."
        )
    run_id = uuid()
    budgets.open_run(run_id, limits)
    return signature.apply_async(root_id=run_id, **options)


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
