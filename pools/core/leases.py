"""Claims held by workers: start and renewal, by compare-and-set on the fencing token.

No pool locks here: these transitions only move an entry between held states
(``admitted`` -> ``running``) or extend its lease, which never changes the held
sum, so a single conditional ``UPDATE`` on the entry row is enough. A fenced start
(PostgreSQL, a worker's own connection) writes nothing at all: a session lock fences it.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.db.models import Case, DateTimeField, F, Value, When
from django.db.models.functions import Coalesce
from django.utils import timezone

from pools import conf
from pools.core import events, locking
from pools.core.engine import engine
from pools.core.records import Claim
from pools.models import PoolEvent, QueueEntry
from pools.states import HELD_STATES, EntryState, EventKind


def start(entry_id: int, token: int, *, worker: str) -> Claim | None:
    """Start an admitted entry on ``worker``; None if the token is stale, it already ran,
    it is pinned to another worker (node affinity: no other worker runs it), or another
    session holds its fence (a duplicate delivery while the body runs).

    On a worker's own PostgreSQL connection the start is *fenced*: a session lock on the
    entry, held for the body, and in the common case no write (``Claim.start_written``
    False; the entry stays ``admitted`` until the first renewal). Elsewhere the entry is
    marked ``running`` (docs/concepts/contract.md, *start*).

    Bounded like every pool operation; a database error or timeout raises
    :class:`~pools.exceptions.PoolUnavailable` and changes nothing.
    """
    return engine().start(entry_id, token, worker=worker[:255])


def renew(
    entry_id: int, token: int, *, started_at: datetime | None = None, worker: str = ""
) -> datetime | None:
    """Extend a held lease; None (the claim is lost) when the token is stale or it lapsed.

    With ``started_at`` (a claim whose start wrote nothing: a fenced start) the renewal
    also marks the entry ``running`` on ``worker``, as the start would have: an entry shows
    as running from its first renewal on.

    Bounded like every pool operation, but a failure surfaces as the database error
    itself: the lease keeper treats any :class:`~django.db.DatabaseError` as a failed
    renewal (one implementation on both paths: no stored function).
    """
    until = timezone.now() + timedelta(seconds=conf.get().LEASE_SECONDS)
    changes: dict[str, Any] = {"lease_expires_at": until}
    if started_at is not None:
        changes.update(
            state=EntryState.RUNNING,
            started_at=Coalesce(F("started_at"), Value(started_at, DateTimeField())),
            worker=Case(When(worker="", then=Value(worker[:255])), default=F("worker")),
        )
    with locking.bounded_transaction():
        changed = QueueEntry.objects.held().filter(pk=entry_id, token=token).update(**changes)
    return until if changed else None


def renew_if_ending(entry_id: int, token: int, *, within: float) -> datetime | None:
    """Renew a held lease only if it ends within ``within`` seconds; the new end, else None.

    None says nothing was written: enough of the lease is left (its holder renews it), or
    the token is stale. For a second renewer beside the lease keeper (a worker's main
    process while its pool process cannot run Python): the common case writes no row.
    Same bound and errors as :func:`renew`.
    """
    now = timezone.now()
    until = now + timedelta(seconds=conf.get().LEASE_SECONDS)
    with locking.bounded_transaction():
        changed = (
            QueueEntry.objects.held()
            .filter(pk=entry_id, token=token, lease_expires_at__lt=now + timedelta(seconds=within))
            .update(lease_expires_at=until)
        )
    return until if changed else None


def redeliver(entry_id: int, token: int) -> bool:
    """A running attempt handed its message back to the broker (``Reject(requeue=True)``).

    The claim stays valid for the redelivery: the entry goes back to ``admitted`` with the
    same fencing token and a fresh lease, so the broker's redelivered message (Celery marks
    it ``redelivered``) starts it again, as plain Celery runs it again. If that message
    never comes, the lease lapses and the entry goes back in line. Returns False for a
    stale token. Held slots do not change, so no pool lock is needed (see module docstring).
    """
    until = timezone.now() + timedelta(seconds=conf.get().LEASE_SECONDS)
    with locking.bounded("handing a claim back for redelivery"):
        changed = QueueEntry.objects.filter(
            pk=entry_id,
            token=token,
            state__in=HELD_STATES,  # admitted: a fenced start
        ).update(state=EntryState.ADMITTED, lease_expires_at=until, reason="redelivery")
    return bool(changed)


def record_skipped(entry_id: int | None, key: str, token: int | None, why: str) -> None:
    """Log a delivery that was not run (stale token, no claim); sends ``delivery_skipped``."""
    event = PoolEvent(
        at=timezone.now(),
        kind=EventKind.SKIPPED,
        entry_id=entry_id,
        key=key,
        token=token,
        detail={"why": why},
    )
    events.save_rows(EventKind.SKIPPED, [event])
