"""Pooled tasks used by the acceptance tests (run by real worker processes)."""

from __future__ import annotations

import os
import time

from celery import shared_task

from pools import current_claim, pooled


@shared_task
@pooled("warehouse", slots=1)
def record(i: int, sleep: float = 0.05) -> dict:
    """Sleep briefly and return when (and where) the body ran."""
    start = time.time()
    time.sleep(sleep)
    claim = current_claim()
    return {"i": i, "start": start, "end": time.time(), "pid": os.getpid(),
            "token": claim.token if claim else None}


@shared_task
@pooled("warehouse", slots=1)
def add(x: int, y: int) -> int:
    return x + y


@shared_task
@pooled("partner-api")
def tsum(values: list[int]) -> int:
    return sum(values)
