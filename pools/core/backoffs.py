"""Backoff: a task body asked its pools to pause (a partner answered 429), a timed pause.

A backoff is the pool's ``paused`` flag with an end time, ``Pool.backoff_until``. While it
is set ``paused`` is true, so both engines admit nothing from the pool, the PostgreSQL
stored functions included (they skip paused pools; an enqueue into a paused pool with
``paused_policy="reject"`` is handed to the ORM engine, which queues it: a backoff never
refuses a submit). No stored function changes.

* :func:`back_off` (the worker, under the pools' locks of the entry): the held attempt goes
  back to its place in line (waiting, ``priority`` and ``enqueued_at`` kept, slots
  released, ``backoffs`` + 1), and the chosen pools pause until ``now + seconds`` (a later
  end wins when one is already running). A pool paused by hand stays paused by hand.
* The end: the first admission pass at or after ``backoff_until`` resumes the pool under
  its lock (:func:`pools.core.backoff_ends.end_due_locked`); a timed wake-up is scheduled for
  that moment, and the sweep (:func:`end_due`) is the safety net after a restart.
* :func:`end_early` (admin, REST API): resume a pool in backoff now.
* A pause or resume by hand (:func:`pools.core.capacity.set_paused`, an edit of ``paused``,
  settings sync of a pool declared paused) ends the backoff: the pool is then paused or
  resumed for good.

Lock order: the pool rows of the entry in name order (``locking.locked_pools``), then the
entry and its demand rows, as every admission service.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import transaction
from django.utils import timezone

from pools.core import backoff_ends, dispatch, events, pass_runs
from pools.core.held import change_held
from pools.core.locking import locked_pools, unavailable_on_error
from pools.core.pass_runs import admit_in, follow_up
from pools.exceptions import UnknownPool
from pools.models import Demand, Pool, QueueEntry
from pools.states import HELD_STATES, EntryState, EventKind

logger = logging.getLogger("pools.core.backoffs")

#: The reason a backed-off entry carries while it waits again.
REASON = "backoff"


@dataclass(frozen=True, kw_only=True)
class BackedOff:
    """What :func:`back_off` did."""

    #: False when the token was stale (nothing changed) or the limit was reached.
    requeued: bool
    #: True when the entry had already backed off ``limit`` times (nothing changed).
    exceeded: bool = False
    #: The entry's backoff count after this one.
    backoffs: int = 0
    #: The pools paused, and until when.
    pools: tuple[str, ...] = ()
    until: datetime | None = None


def chosen_pools(demand: Iterable[str], asked: Iterable[str] | None) -> list[str]:
    """The pools a backoff pauses: those of ``asked`` the entry names, or all of its pools
    when ``asked`` is None (or names none of them)."""
    names = sorted(demand)
    if asked is None:
        return names
    picked = sorted(set(asked) & set(names))
    return picked or names


def in_backoff(pool: Pool, now: datetime) -> bool:
    """True while ``pool`` is paused by a backoff that has not ended."""
    return pool.backoff_until is not None and pool.backoff_until > now


def back_off(
    entry_id: int,
    token: int,
    seconds: float,
    *,
    pools: Iterable[str] | None = None,
    limit: int,
) -> BackedOff:
    """End the held attempt ``entry_id``/``token`` without failing it and pause its pools.

    ``limit``: the backoffs allowed to this entry; an entry that already used them is left
    alone (``exceeded``: the caller fails the task). Returns ``requeued=False`` for a stale
    token (the claim was lost: the entry is someone else's now).
    """
    with unavailable_on_error(f"backing off entry {entry_id}"):
        entry = QueueEntry.objects.filter(pk=entry_id).only("demand", "backoffs").first()
    if entry is None:
        return BackedOff(requeued=False)
    now = timezone.now()
    until = now + timedelta(seconds=seconds)
    names = chosen_pools(entry.demand, pools)
    with locked_pools(entry.demand) as locked:
        held = QueueEntry.objects.filter(pk=entry_id, token=token, state__in=HELD_STATES).first()
        if held is None:
            return BackedOff(requeued=False)
        if held.backoffs >= limit:
            return BackedOff(requeued=False, exceeded=True, backoffs=held.backoffs)
        # Compare-and-set on the token: leases.start/renew do not take the pool lock.
        QueueEntry.objects.filter(pk=entry_id, token=token, state__in=HELD_STATES).update(
            state=EntryState.WAITING,
            lease_expires_at=None,
            worker="",
            reason=REASON,
            backoffs=held.backoffs + 1,
        )
        held.refresh_from_db()
        Demand.objects.filter(entry_id=entry_id).update(state=EntryState.WAITING)
        change_held(locked, [held], -1)
        paused = [locked[name] for name in names if name in locked]
        for pool in paused:
            _pause(pool, until, now)
        events.record(
            EventKind.BACKOFF,
            [held],
            at=now,
            detail={"seconds": seconds, "until": until.isoformat(), "paused": names},
        )
        # Its other pools are not paused: the pass admits there what may go (not this
        # entry, which waits for all of its pools).
        needs = admit_in(locked, now)
        transaction.on_commit(lambda: dispatch.wake(names, until))
    follow_up(needs)
    logger.info(
        "Entry %s backed off for %gs (attempt %d): pools %s paused until %s",
        entry_id,
        seconds,
        held.backoffs,
        ", ".join(names),
        until.isoformat(),
    )
    return BackedOff(requeued=True, backoffs=held.backoffs, pools=tuple(names), until=until)


def _pause(pool: Pool, until: datetime, now: datetime) -> None:
    """Pause a locked pool until ``until`` (a later running backoff wins); count it."""
    manual = pool.paused and pool.backoff_until is None
    if not manual and (pool.backoff_until is None or pool.backoff_until < until):
        pool.paused, pool.backoff_until = True, until
    pool.backoffs += 1
    pool.save(update_fields=["paused", "backoff_until", "backoffs", "updated_at"])


def end_due(now: datetime | None = None) -> list[str]:
    """The sweep's part: resume every pool whose backoff has ended, then admit there."""
    names = backoff_ends.ended(now or timezone.now())
    if not names:
        return []
    pass_runs.run_pass(names)  # the pass ends them under the locks
    return names


def end_early(name: str, *, actor: str | None = None) -> bool:
    """Resume pool ``name`` now if it is in backoff (admin, REST API); admission runs after
    commit. Returns False when the pool was not in backoff (a pause by hand is left
    alone: resume it instead). Raises :class:`UnknownPool`."""
    now = timezone.now()
    with locked_pools([name]) as locked:
        pool = locked.get(name)
        if pool is None:
            raise UnknownPool(name)
        if pool.backoff_until is None:
            return False
        backoff_ends.resume(pool, now, reason="early", actor=actor)
        needs = admit_in(locked, now)
    follow_up(needs)
    return True
