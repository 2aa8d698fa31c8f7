"""Admission: the services that change a waiting or held entry, on the connection's engine.

Invariant protected: for every pool, the slots held by its admitted and running entries
never exceed its capacity. Every change to a *waiting* or *held* entry (enqueue, admit,
settle, cancel, requeue, expire) runs with the locks of all the pools the entry names, so
the sum computed under the lock is exact.

Order of admission: the pool's strategy (:mod:`pools.core.strategies`): by default
priority descending, then ``enqueued_at``, then ``queue_id``. A pool's head waits until
all of its slots are free and blocks everything behind it (no backfill). A multi-pool
entry is admitted only where it is the head of every pool it names, and then acquires all
of them at once. An entry whose ``not_before`` is ahead is not in line (its demand rows
are ``delayed``) and blocks nothing; a timed wake-up moves it into line when it is due.

Transactions are short: task bodies and broker publishes run after commit
(:mod:`pools.core.dispatch`).

Where each part lives: the engine interface :mod:`pools.core.engine` (ORM engine
:mod:`pools.core.engines.orm`, PostgreSQL engine :mod:`pools.pg.engine`); the pass
:mod:`pools.core.admission_pass` and :mod:`pools.core.pass_runs`; held-slot counters
:mod:`pools.core.held`; enqueue, refusals and idempotency :mod:`pools.core.enqueueing`;
job supersession :mod:`pools.core.supersession`; settle, requeue, cancel and expire
:mod:`pools.core.settling`; calls inside a caller's transaction
:mod:`pools.core.in_transaction`; many calls in one transaction (fan-out)
:mod:`pools.core.fanout`; debounced calls (one waiting entry per key)
:mod:`pools.core.debounce`. The contract both engines implement is
``docs/concepts/contract.md``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from datetime import datetime, timedelta

from django.utils import timezone

from pools.core import budgets
from pools.core.engine import engine
from pools.core.enqueueing import deadline_of, holder_of
from pools.core.in_transaction import (
    enqueue_in_callers_transaction,
    in_callers_transaction,
    note_due_entries,
)
from pools.core.pass_runs import admit_all, follow_up
from pools.core.records import Admission, Enqueued, Submission
from pools.core.settling import (
    TERMINATING,
    cancel,
    cancel_if_waiting,
    cancel_waiting,
    expire_due,
)
from pools.core.supersession import end_waiting_of_job, supersede_retries

__all__ = [
    "TERMINATING",
    "admit",
    "admit_all",
    "cancel",
    "cancel_if_waiting",
    "cancel_waiting",
    "end_waiting_of_job",
    "enqueue",
    "expire_due",
    "follow_up",
    "holder_of",
    "note_due_entries",
    "requeue",
    "settle",
    "supersede_retries",
]


def enqueue(sub: Submission) -> Enqueued:
    """Put a call in line and admit whatever fits, in one transaction.

    Raises :class:`UnknownPool`, :class:`DemandExceedsCapacity`, :class:`PoolPaused`,
    :class:`PoolDraining`, :class:`PoolFull` or :class:`PoolUnavailable`; nothing is written
    when it raises. A full pool whose overflow policy drops an entry drops it instead.

    A submit with an idempotency key (``skip``: its job's) that matches an unfinished entry
    creates nothing and returns that entry (``created=False``); the database's unique index
    decides between concurrent submits. Submits with a job, a policy, a key or a pinned
    worker take the ORM engine on every database (see :func:`pools.pg.engine.handed_to_orm`).
    """
    now = timezone.now()
    if sub.debounce_key is not None and sub.debounce is not None:
        # Its quiet time: the run starts no earlier than ``debounce`` seconds from now.
        quiet = now + timedelta(seconds=sub.debounce)
        sub = replace(sub, not_before=max(quiet, sub.not_before or quiet))
    deadline = deadline_of(sub, now)
    budgeted = budgets.may_have_budget(sub) and bool(
        sub.spec.budget or budgets.has_budget(budgets.run_id_of(sub))
    )
    if (
        not budgeted and sub.debounce_key is None and in_callers_transaction()
    ):  # no pool lock until the caller commits
        written = enqueue_in_callers_transaction(sub, now, deadline)
        if written is not None:
            return written
    return engine().enqueue(sub, now, deadline, budgeted=budgeted)


def settle(
    entry_id: int, token: int, outcome: str, *, reason: str = "", live_lease: bool = False
) -> bool:
    """Finish a held attempt (exactly once per token), then admit the next entries.

    Returns False, changing nothing, when the token is stale, the entry already settled,
    or (``live_lease=True``, used by workers) its lease has already lapsed.
    """
    return engine().settle(entry_id, token, outcome, reason=reason, live_lease=live_lease)


def requeue(
    entry_id: int,
    token: int,
    *,
    reason: str,
    admit: bool = True,
    lapsed_before: datetime | None = None,
    unstarted: bool = False,
) -> bool:
    """Put a held entry back in line (same place), or expire it if its deadline passed.

    Used when a lease lapses or is lost, and when a publish fails; then ``admit=False``
    leaves re-admission to the next settle or sweep, so a broker outage cannot turn
    into a publish loop. ``unstarted=True`` (a message that may not have reached a worker)
    leaves an entry a worker has already started alone. Returns False for a stale token.
    """
    return engine().requeue(
        entry_id,
        token,
        reason=reason,
        admit=admit,
        lapsed_before=lapsed_before,
        unstarted=unstarted,
    )


def admit(names: Iterable[str]) -> list[Admission]:
    """Run an admission pass over the named pools; returns what was admitted."""
    return engine().admit(names)


def wake(names: Iterable[str]) -> list[Admission]:
    """A timed wake-up's admission pass over the named pools: run now, or (PostgreSQL)
    left to a process holding their locks, which runs it after its commit; returns what
    this call admitted."""
    return engine().wake(names)
