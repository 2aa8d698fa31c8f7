"""The start of an admitted entry: compare-and-set on its fencing token (``admitted`` ->
``running``), its lease, its ``started`` event. The ORM engine's start, and the last step of
a rated start (:mod:`pools.core.starts`) under its pools' locks."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db.models import Case, F, Q, Value, When
from django.utils import timezone

from pools import conf
from pools.core import events, locking
from pools.core.records import Claim
from pools.models import QueueEntry
from pools.states import EntryState, EventKind


def start(entry_id: int, token: int, *, worker: str) -> Claim | None:
    """Mark an admitted entry running on ``worker`` (already cut to 255 characters)."""
    with locking.bounded("starting a claim"):
        return mark_running(entry_id, token, worker=worker, now=timezone.now())


def mark_running(entry_id: int, token: int, *, worker: str, now: datetime) -> Claim | None:
    """The start itself, inside the caller's transaction: compare-and-set on the token
    (``admitted`` -> ``running``), the lease, the ``started`` event. Also the last step of a
    rated start (:mod:`pools.core.starts`), under its pools' locks."""
    lease = conf.get().LEASE_SECONDS
    renewed = now + timedelta(seconds=lease)
    changed = QueueEntry.objects.filter(
        Q(pinned_worker="") | Q(pinned_worker=worker),
        pk=entry_id,
        token=token,
        state=EntryState.ADMITTED,
    ).update(
        state=EntryState.RUNNING,
        started_at=now,
        worker=worker,
        lease_expires_at=Case(  # kept when 2/3 of it are left: as the start function
            When(
                lease_expires_at__gte=now + timedelta(seconds=lease * 2 / 3),
                then=F("lease_expires_at"),
            ),
            default=Value(renewed),
        ),
    )
    if not changed:
        return None
    entry = QueueEntry.objects.only("key", "token", "demand", "lease_expires_at").get(pk=entry_id)
    until = entry.lease_expires_at or renewed
    events.transition(EventKind.STARTED, [entry], at=now, detail={"worker": worker})
    return Claim(entry_id=entry_id, token=token, demand=entry.demand, lease_expires_at=until)
