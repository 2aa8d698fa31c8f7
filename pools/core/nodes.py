"""Worker liveness: one row per Celery hostname, refreshed by a heartbeat."""

from __future__ import annotations

import os
from datetime import timedelta

from django.utils import timezone

from pools import conf
from pools.models import WorkerNode


def beat(hostname: str) -> None:
    """Record that ``hostname`` is alive now."""
    now = timezone.now()
    updated = WorkerNode.objects.filter(hostname=hostname).update(last_seen=now, pid=os.getpid())
    if not updated:
        WorkerNode.objects.update_or_create(
            hostname=hostname,
            defaults={"last_seen": now, "started_at": now, "pid": os.getpid()},
        )


def gone(hostname: str) -> None:
    """Forget ``hostname`` (clean shutdown)."""
    WorkerNode.objects.filter(hostname=hostname).delete()


def live_hostnames() -> set[str]:
    """Hostnames seen within ``NODE_TIMEOUT_SECONDS``."""
    since = timezone.now() - timedelta(seconds=conf.get().NODE_TIMEOUT_SECONDS)
    return set(WorkerNode.objects.filter(last_seen__gte=since).values_list("hostname", flat=True))
