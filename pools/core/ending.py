"""Ending waiting entries: the rows, events and results of an entry that leaves the line
without running (expired, cancelled, superseded, rejected). Callers hold the pools' locks.
"""

from __future__ import annotations

from datetime import datetime

from pools.core import events
from pools.core.records import EXPIRES, QUEUE_TIMEOUT, Finished
from pools.models import Demand, QueueEntry
from pools.states import EntryState, EventKind


def finish_waiting(
    entries: list[QueueEntry],
    state: EntryState,
    now: datetime,
    *,
    reason: str,
    actor: str | None = None,
) -> list[Finished]:
    """End waiting ``entries`` in ``state`` with ``reason`` (an event each); their results."""
    ids = [e.queue_id for e in entries]
    QueueEntry.objects.filter(pk__in=ids, state=EntryState.WAITING).update(
        state=state, finished_at=now, reason=reason
    )
    Demand.objects.filter(entry_id__in=ids).update(state=state)
    kinds: dict[EntryState, EventKind] = {
        EntryState.EXPIRED: EventKind.EXPIRED,
        EntryState.CANCELLED: EventKind.CANCELLED,
        EntryState.SUPERSEDED: EventKind.SUPERSEDED,
    }
    kind = kinds.get(state, EventKind.REJECTED)
    events.record(kind, entries, at=now, detail={"reason": reason}, actor=actor)
    return [
        Finished(
            entry_id=e.queue_id,
            key=e.key,
            task_name=e.task_name,
            state=state,
            pool=next(iter(e.demand)),
            deadline=e.deadline,
            options=e.options,
            reason=reason,
        )
        for e in entries
    ]


def expiry_reason(entry: QueueEntry) -> str:
    """``expired`` when Celery's ``expires`` set the deadline, else ``queue_timeout``."""
    expires = (entry.options or {}).get("expires")
    if expires and entry.deadline is not None:
        if entry.deadline >= datetime.fromisoformat(expires):
            return EXPIRES
    return QUEUE_TIMEOUT


def expire_entries(entries: list[QueueEntry], now: datetime) -> list[Finished]:
    """End waiting entries whose deadline passed, each with its reason."""
    by_reason: dict[str, list[QueueEntry]] = {}
    for entry in entries:
        by_reason.setdefault(expiry_reason(entry), []).append(entry)
    finished: list[Finished] = []
    for reason, group in by_reason.items():
        finished += finish_waiting(group, EntryState.EXPIRED, now, reason=reason)
    return finished
