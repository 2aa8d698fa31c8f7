"""What every benchmark body does, pooled, plain or limited by the recipe: no task here.

A body returns its own timestamps, so the benchmark counts and times from what the bodies
saw: ``{"i": index, "s": start, "e": end, "p": pid, "r": retries}`` (``time.time()``: one
clock for every process here). :mod:`pools.bench.tasks` and :mod:`pools.bench.recipe` wrap
it in their tasks.
"""

from __future__ import annotations

import os
import time
from typing import Any


def span(i: int, sleep: float, retries: int = 0) -> dict[str, Any]:
    """Run a body of ``sleep`` seconds (0: no-op) and return when and where it ran."""
    start = time.time()
    if sleep > 0:
        time.sleep(sleep)
    return {"i": i, "s": start, "e": time.time(), "p": os.getpid(), "r": retries}
