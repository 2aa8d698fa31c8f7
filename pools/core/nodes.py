"""Worker liveness: one row per Celery hostname, refreshed by a heartbeat."""

from __future__ import annotations

import os
from datetime import timedelta

from django.utils import timezone

from pools import conf
from pools.models import QueueEntry, WorkerNode


def beat(hostname: str) -> bool:
    """Record that ``hostname`` is alive now; True when it was not live before (a join).

    One UPDATE while the worker stays live. A join is when entries pinned to the worker
    (node affinity) may become eligible: the caller then runs admission over their pools.
    """
    now = timezone.now()
    live_since = now - timedelta(seconds=conf.get().NODE_TIMEOUT_SECONDS)
    updated = WorkerNode.objects.filter(hostname=hostname, last_seen__gte=live_since).update(
        last_seen=now, pid=os.getpid()
    )
    if updated:
        return False
    WorkerNode.objects.update_or_create(
        hostname=hostname,
        defaults={"last_seen": now, "started_at": now, "pid": os.getpid()},
    )
    return True


def pinned_pools(hostname: str) -> set[str]:
    """Pools of the waiting entries pinned to ``hostname`` (read when the worker joins)."""
    names: set[str] = set()
    for demand in (
        QueueEntry.objects.waiting()
        .filter(pinned_worker=hostname, finished_at__isnull=True)
        .values_list("demand", flat=True)[:1000]
    ):
        names |= set(demand)
    return names


def gone(hostname: str) -> None:
    """Forget ``hostname`` (clean shutdown)."""
    WorkerNode.objects.filter(hostname=hostname).delete()


def live_hostnames() -> set[str]:
    """Hostnames seen within ``NODE_TIMEOUT_SECONDS``."""
    since = timezone.now() - timedelta(seconds=conf.get().NODE_TIMEOUT_SECONDS)
    return set(WorkerNode.objects.filter(last_seen__gte=since).values_list("hostname", flat=True))
