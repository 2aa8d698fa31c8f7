"""The admin's "Run now": :func:`pools.celery.jobs.start_job` and a message saying what happened."""

from __future__ import annotations

from django.contrib import messages
from django.db import DatabaseError

from pools.celery import jobs
from pools.core import line_places
from pools.exceptions import PoolError, PoolUnavailable
from pools.models import Pool, QueueEntry
from pools.states import HELD_STATES, EntryState, Origin


def _where(queue_id: int | None) -> str:
    """``admitted at once`` / ``waiting, position 3 in warehouse`` for a fresh entry."""
    if queue_id is None:
        return "queued"
    entry = QueueEntry.objects.filter(pk=queue_id).first()
    if entry is None:
        return "queued"
    if entry.state != EntryState.WAITING:
        return "admitted at once" if entry.state in HELD_STATES else str(entry.state)
    places = []
    for pool in Pool.objects.filter(name__in=list(entry.demand)).order_by("name"):
        position = line_places.positions(pool, [entry]).get(entry.queue_id)
        if position is not None:
            places.append(f"position {position} in {pool.name}")
        elif entry.not_before is not None:
            places.append(f"due at {entry.not_before:%H:%M:%S} in {pool.name}")
    return "waiting" + (f", {', '.join(places)}" if places else "")


def run_now(name: str) -> tuple[int, str]:
    """Start periodic task ``name`` now; ``(message level, message)`` for the admin."""
    try:
        started = jobs.start_job(name, origin=Origin.MANUAL)
    except (PoolUnavailable, DatabaseError):
        return messages.ERROR, f"{name}: pool state is unavailable; the job was not started."
    except PoolError as exc:  # unknown job, a pool's refusal (full, draining, ...)
        return messages.WARNING, f"{name}: not started. {exc}"
    if not started.queued:
        return messages.SUCCESS, f"{name}: sent to Celery (not pooled), task id {started.key}."
    pools = ", ".join(started.pools) or started.pool or "?"
    return (
        messages.SUCCESS,
        f"{name}: queued in {pools} as entry #{started.queue_id} "
        f"({_where(started.queue_id)}), task id {started.key}.",
    )
