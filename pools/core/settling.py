"""Ending held and waiting entries on the ORM engine: settle, requeue, cancel and expire,
each under the locks of the entry's pools, followed by an admission pass.

The contract is ``docs/concepts/contract.md``; the public services are re-exported by
:mod:`pools.core.admission`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from datetime import datetime

from django.db import transaction
from django.db.models import Case, Value, When
from django.utils import timezone

from pools.core import budgets, dispatch, events, spendcap
from pools.core.ending import expire_entries, finish_waiting
from pools.core.held import change_held
from pools.core.locking import locked_pools, unavailable_on_error
from pools.core.pass_runs import admit_in, admit_later, end_waiting, follow_up, on_unpublished
from pools.core.records import BUDGET, Admission
from pools.core.supersession import supersede_retries
from pools.exceptions import EntryNotFound, NotCancellable
from pools.models import Demand, Pool, QueueEntry
from pools.states import HELD_STATES, ConcurrencyPolicy, EntryState, EventKind

logger = logging.getLogger("pools.core.admission")

#: ``reason`` of a held entry whose termination was requested (``cancel(terminate=True)``).
TERMINATING = "terminating"


def settle_with_locks(
    entry_id: int, token: int, outcome: str, *, reason: str = "", live_lease: bool = False
) -> bool:
    """:func:`pools.core.admission.settle` on the ORM engine: under the pools' locks."""
    with unavailable_on_error(f"settling entry {entry_id}"):
        entry = QueueEntry.objects.filter(pk=entry_id).only("demand", "job").first()
    if entry is None:
        return False
    now = timezone.now()
    with locked_pools(entry.demand) as pools:
        claim = QueueEntry.objects.filter(pk=entry_id, token=token, state__in=HELD_STATES)
        if live_lease:
            claim = claim.filter(lease_expires_at__gte=now)
        # cancel(terminate=True) marked it before the worker stopped the body: the attempt
        # ends as a cancellation whatever state Celery gave it. Read under the lock.
        terminating = When(reason=TERMINATING, then=Value(EntryState.CANCELLED.value))
        changed = claim.update(
            state=Case(terminating, default=Value(outcome)),
            reason=Case(When(reason=TERMINATING, then=Value("revoked")), default=Value(reason)),
            finished_at=now,
            lease_expires_at=None,
        )
        if changed:
            entry.refresh_from_db(fields=["key", "token", "demand", "state", "admitted_at"])
            spendcap.add_spend(pools, entry, now)
            Demand.objects.filter(entry_id=entry_id).update(state=entry.state)
            change_held(pools, [entry], -1)
            events.transition(EventKind.SETTLED, [entry], at=now, detail={"outcome": entry.state})
            needs = admit_in(pools, now)
    if changed:
        follow_up(needs | forbid_waiters(entry.job, pools))
    return bool(changed)


def forbid_waiters(job: str, locked: Iterable[str]) -> set[str]:
    """Pools (beyond ``locked``) of ``forbid`` instances of ``job`` that wait: an instance
    of the job just finished, so they may be eligible now. Empty without a job.

    Read after the settle committed: a failure asks for a pass over ``locked`` later (which
    reaches the job's waiting instances through the sweep) instead of failing the settle.
    """
    if not job:
        return set()
    names: set[str] = set()
    waiting = QueueEntry.objects.waiting().filter(
        job=job, finished_at__isnull=True, concurrency_policy=ConcurrencyPolicy.FORBID
    )
    try:
        for demand in waiting.values_list("demand", flat=True)[:100]:
            names |= set(demand)
    except Exception as exc:
        admit_later(locked, exc)
    return names - set(locked)


def requeue(
    entry_id: int,
    token: int,
    *,
    reason: str,
    admit: bool = True,
    lapsed_before: datetime | None = None,
    unstarted: bool = False,
    hold: Callable[[dict[str, Pool]], None] | None = None,
) -> bool:
    """Put a held entry back in line (same place), or expire it if its deadline passed.

    Used when a lease lapses or is lost, and when a publish fails; then ``admit=False``
    leaves re-admission to the next settle or sweep, so a broker outage cannot turn
    into a publish loop. ``unstarted=True`` (a message that may not have reached a worker)
    leaves an entry a worker has already started alone. ``hold`` runs under the pools'
    locks before the admission pass (a rated start postponed holds the pools' next
    admissions: :func:`pools.core.starts.postpone`). Returns False for a stale token.
    """
    with unavailable_on_error(f"requeueing entry {entry_id}"):
        entry = QueueEntry.objects.filter(pk=entry_id).only("demand").first()
    if entry is None:
        return False
    now = timezone.now()
    with locked_pools(entry.demand) as pools:
        states = [EntryState.ADMITTED] if unstarted else HELD_STATES
        claim = QueueEntry.objects.filter(pk=entry_id, token=token, state__in=states)
        if lapsed_before is not None:  # re-checked under the lock: a start may have renewed it
            claim = claim.filter(lease_expires_at__lt=lapsed_before)
        # Compare-and-set: leases.start/renew do not take the pool lock.
        if not claim.update(
            state=EntryState.WAITING, lease_expires_at=None, worker="", reason=reason
        ):
            return False
        entry = QueueEntry.objects.get(pk=entry_id)
        Demand.objects.filter(entry_id=entry_id).update(state=EntryState.WAITING)
        change_held(pools, [entry], -1)
        if hold is not None:
            hold(pools)
        events.record(EventKind.REQUEUED, [entry], at=now, detail={"reason": reason})
        stop = budgets.rejects_requeue(entry)
        if stop is not None:  # its run has spent a budget: it does not wait again
            finished = [
                replace(f, budget=stop)
                for f in finish_waiting([entry], EntryState.REJECTED, now, reason=BUDGET)
            ]
            needs = admit_in(pools, now, finished)
        # The pass expires it if its deadline is gone, or admits it again.
        elif admit:
            needs = admit_in(pools, now)
        else:
            needs = set()
    follow_up(needs)
    return True


def _requeue_unpublished(admission: Admission, reason: str) -> None:
    """After-commit work failed before ``admission``'s message was handed to the broker: put
    it back in line at once (``dispatch.after_commit``'s ``requeue``), not at lease lapse."""
    try:
        requeue(
            admission.entry_id, admission.token, reason=reason[:255], admit=False, unstarted=True
        )
    except Exception:
        logger.exception("Could not requeue entry %s; its lease will lapse", admission.entry_id)


on_unpublished(_requeue_unpublished)


def cancel(
    key: str, *, reason: str = "cancelled", terminate: bool = False, actor: str | None = None
) -> QueueEntry:
    """Cancel the entry with ``key``: a waiting one now (its result becomes a revocation).

    ``actor`` (a username, from the admin or the REST API) is logged with the event.

    With ``terminate=True`` an admitted or running entry is revoked in Celery
    (``revoke(terminate=True)``); its slots are freed once the worker has stopped it.
    Raises :class:`EntryNotFound` for an unknown key and :class:`NotCancellable`
    when the entry is finished, or running and ``terminate`` is false.
    """
    with unavailable_on_error(f"cancelling entry {key!r}"):
        entry = QueueEntry.objects.filter(key=key).order_by("-queue_id").first()
    if entry is None:
        raise EntryNotFound(key)
    now = timezone.now()
    needs: set[str] = set()
    with locked_pools(entry.demand) as pools:
        entry.refresh_from_db()
        if entry.state in HELD_STATES and terminate:
            QueueEntry.objects.filter(pk=entry.pk).update(reason=TERMINATING)
            events.record(
                EventKind.TERMINATE, [entry], at=now, detail={"reason": reason}, actor=actor
            )
            transaction.on_commit(lambda: dispatch.bridge().terminate(key))
        else:
            if entry.state != EntryState.WAITING:
                pool = next(iter(entry.demand))
                if entry.state in HELD_STATES:
                    why = "is already running; pass terminate=True to stop it"
                else:
                    why = f"is already {entry.state}"
                raise NotCancellable(
                    f"Entry {key!r} in pool {pool!r} {why}; only waiting entries can be cancelled."
                )
            finished = finish_waiting(
                [entry], EntryState.CANCELLED, now, reason=reason, actor=actor
            )
            needs = admit_in(pools, now, finished)
    follow_up(needs)
    # A cancellation of the job supersedes its queued retries (docs/howto/job-policies.md).
    if entry.job:
        supersede_retries(entry.job, reason=f"job {entry.job} was cancelled ({key})")
    entry.refresh_from_db()
    return entry


def expire_due(now: datetime, *, limit: int = 500) -> int:
    """Expire waiting entries whose deadline has passed (sweep); returns how many."""
    rows = list(
        QueueEntry.objects.waiting()
        # past its deadline: deadline <= now, as in the pass (unfinished: the index's rows)
        .filter(deadline__lte=now, finished_at__isnull=True)
        .order_by("deadline")
        .values_list("queue_id", "demand")[:limit]
    )
    return end_waiting(rows, now, expire_entries)


def cancel_waiting(entry_ids: Sequence[int], *, reason: str, actor: str | None = None) -> int:
    """Cancel those of ``entry_ids`` still waiting (each result becomes a revocation).

    Returns how many were cancelled; an entry admitted meanwhile is left alone. Used by
    ``app.control.purge()`` (:mod:`pools.celery.purge`).
    """
    now = timezone.now()
    cancelled = 0
    for start in range(0, len(entry_ids), 500):
        with unavailable_on_error("cancelling waiting entries"):
            rows = list(
                QueueEntry.objects.waiting()
                .filter(pk__in=entry_ids[start : start + 500])
                .values_list("queue_id", "demand")
            )
        cancelled += end_waiting(
            rows,
            now,
            lambda entries, at: finish_waiting(
                entries, EntryState.CANCELLED, at, reason=reason, actor=actor
            ),
        )
    return cancelled


def cancel_if_waiting(key: str, *, reason: str) -> bool:
    """Cancel ``key`` if it is waiting; False (no error) otherwise. Used by ``revoke()``."""
    if not QueueEntry.objects.waiting().filter(key=key).exists():
        return False
    try:
        cancel(key, reason=reason)
    except (EntryNotFound, NotCancellable):
        return False
    return True
