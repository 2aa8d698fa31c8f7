"""Tasks of the rate-limit acceptance tests (issue 17), run by real worker processes.

Each body reports when it started (``time.time()`` on its first line: every process here
reads one clock), when it ended, and the claim it ran under. The pools are created by the
tests themselves, each with its rate (``tests/acceptance/test_rates_workers.py``).
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import shared_task

from pools import current_claim, pooled

#: A pool with a rate and no slots: ``{"rate": "20/s"}``.
RATE_POOL = "rate-20"
#: Two rates at once: ``{"rate": ["5/s", "30/m"]}``.
TWO_RATES_POOL = "rate-two"
#: Slots and a rate: ``{"slots": 2, "rate": "20/s"}``.
SLOTS_RATE_POOL = "rate-slots"


def _started(i: int, sleep: float) -> dict[str, Any]:
    start = time.time()
    if sleep > 0:
        time.sleep(sleep)
    claim = current_claim()
    return {
        "i": i,
        "start": start,
        "end": time.time(),
        "pid": os.getpid(),
        "entry_id": claim.entry_id if claim else None,
        "token": claim.token if claim else None,
    }


@shared_task
@pooled(RATE_POOL)
def rated(i: int, sleep: float = 0.0) -> dict[str, Any]:
    """Through the ``"20/s"`` pool."""
    return _started(i, sleep)


@shared_task
@pooled(TWO_RATES_POOL)
def two_rated(i: int, sleep: float = 0.0) -> dict[str, Any]:
    """Through the ``["5/s", "30/m"]`` pool."""
    return _started(i, sleep)


@shared_task
@pooled(SLOTS_RATE_POOL)
def slots_rated(i: int, sleep: float = 0.05) -> dict[str, Any]:
    """Through the 2-slot ``"20/s"`` pool."""
    return _started(i, sleep)


@shared_task
@pooled(rate="20/s")
def own_rate(i: int, sleep: float = 0.0) -> dict[str, Any]:
    """A task rate without a named pool: the task's own rated pool (``task-cap:<task>``)."""
    return _started(i, sleep)


@shared_task
def unrated(i: int, sleep: float = 0.0) -> dict[str, Any]:
    """The same body, not pooled: the control that shows the workers start far more than 20/s."""
    return _started(i, sleep)
