"""Claims held by workers: start and renewal, by compare-and-set on the fencing token.

No pool locks here: these transitions only move an entry between held states
(``admitted`` -> ``running``) or extend its lease, which never changes the held
sum, so a single conditional ``UPDATE`` on the entry row is enough. The one exception is
the start of an entry admitted in a pool with a rate (:func:`start_rated`): its place in
the pool's window of starts is confirmed under the pool's lock (:mod:`pools.core.starts`).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.utils import timezone

from pools import conf
from pools.core import events, locking, starts
from pools.core.engine import engine
from pools.core.records import Claim
from pools.models import PoolEvent, QueueEntry
from pools.states import EntryState, EventKind


def start(entry_id: int, token: int, *, worker: str) -> Claim | None:
    """Mark an admitted entry running on ``worker``; None if the token is stale, it already
    ran, or it is pinned to another worker (node affinity: no other worker runs it).

    Bounded like every pool operation; a database error or timeout raises
    :class:`~pools.exceptions.PoolUnavailable` and changes nothing.
    """
    return engine().start(entry_id, token, worker=worker[:255])


def start_rated(entry_id: int, token: int, *, worker: str) -> Claim | starts.Postponed | None:
    """:func:`start` for an entry admitted in a pool with a rate: it starts when its place in
    each of its pools' windows of starts comes (a short wait is slept through here).

    :class:`~pools.core.starts.Postponed` when the place comes later: the entry is back in
    line, to be admitted again then; the delivery must not run. Same bound and errors as
    :func:`start`. Each check is the engine's (on PostgreSQL one stored function).
    """
    return starts.start(entry_id, token, worker=worker[:255], attempt=engine().try_start_rated)


def renew(entry_id: int, token: int) -> datetime | None:
    """Extend a held lease; None (the claim is lost) when the token is stale or it lapsed.

    Bounded like every pool operation, but a failure surfaces as the database error
    itself: the lease keeper treats any :class:`~django.db.DatabaseError` as a failed
    renewal (one implementation on both paths: no stored function).
    """
    until = timezone.now() + timedelta(seconds=conf.get().LEASE_SECONDS)
    with locking.bounded_transaction():
        changed = (
            QueueEntry.objects.held()
            .filter(pk=entry_id, token=token)
            .update(lease_expires_at=until)
        )
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
            pk=entry_id, token=token, state=EntryState.RUNNING
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
