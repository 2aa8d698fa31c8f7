"""Small helpers to build pools and submissions in tests."""

from __future__ import annotations

import itertools
from typing import Any

from pools.core import admission
from pools.core.records import Enqueued, Submission
from pools.models import Pool
from pools.specs import PoolSpec

_keys = itertools.count(1)


def make_pool(name: str, slots: int, **kw: Any) -> Pool:
    """Create (or reset) a pool."""
    pool, _ = Pool.objects.update_or_create(name=name, defaults={"slots": slots, **kw})
    return pool


def submit(
    pools: str | dict[str, int] = "p",
    slots: int = 1,
    *,
    priority: int = 0,
    key: str | None = None,
    queue_timeout: float | None = None,
    **kw: Any,
) -> Enqueued:
    """Enqueue one submission of a fake task."""
    spec = PoolSpec.build(pools, slots, priority=priority, queue_timeout=queue_timeout)
    return admission.enqueue(
        Submission(
            key=key or f"k{next(_keys)}",
            task_name="tests.fake",
            spec=spec,
            **kw,
        )
    )
