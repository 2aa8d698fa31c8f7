"""Pooled tasks of the browser scenario (imported by the workers through CELERY_IMPORTS)."""

from __future__ import annotations

import time

from celery import shared_task

from pools import pooled


@shared_task
@pooled("warehouse", slots=1)
def slow_add(x: int, y: int, sleep: float = 10.0) -> int:
    """Hold one warehouse slot for ``sleep`` seconds, then add."""
    time.sleep(sleep)
    return x + y


@shared_task
@pooled("partner-api", slots=1)
def collect(values: list[int]) -> int:
    """A chord body on another pool."""
    return sum(values)
