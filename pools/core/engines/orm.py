"""The ORM engine: every operation through Django's ORM, on every database.

Row locks are taken through :mod:`pools.core.locking` (pool rows ``FOR UPDATE`` in name
order, then entry and demand rows of those pools), so no transaction can deadlock another.
On SQLite ``select_for_update`` is a no-op and the database must run ``IMMEDIATE``
transactions, which serialize writers. ``tests/integration/pg/test_differential.py`` holds
this engine and the PostgreSQL one to ``docs/concepts/contract.md``.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from pools.core import pass_runs, running, settling, starts
from pools.core.debounce import enqueue_debounced
from pools.core.enqueueing import enqueue_with_locks
from pools.core.records import Admission, Claim, Enqueued, Submission
from pools.core.starts import Postponed


class OrmEngine:
    """The operations of :class:`pools.core.engine.Engine` on Django's ORM."""

    name = "orm"
    own_worker_connection = False

    def enqueue(
        self, sub: Submission, now: datetime, deadline: datetime | None, *, budgeted: bool
    ) -> Enqueued:
        """Enqueue under the pools' locks (the run's first when ``budgeted``); a debounced
        submit collapses into the waiting entry of its key (:mod:`pools.core.debounce`)."""
        if sub.debounce_key is not None:
            return enqueue_debounced(sub, now, deadline, budgeted=budgeted)
        return enqueue_with_locks(sub, now, deadline, budgeted=budgeted)

    def start(self, entry_id: int, token: int, *, worker: str) -> Claim | None:
        """Start by compare-and-set on the fencing token (no pool lock)."""
        return running.start(entry_id, token, worker=worker)

    def try_start_rated(
        self, entry_id: int, token: int, *, worker: str
    ) -> Claim | Postponed | None:
        """One check of a rated start under the pools' locks (:mod:`pools.core.starts`)."""
        return starts.try_start(entry_id, token, worker=worker)

    def settle(
        self, entry_id: int, token: int, outcome: str, *, reason: str, live_lease: bool
    ) -> bool:
        """Settle under the pools' locks, then the admission pass."""
        return settling.settle_with_locks(
            entry_id, token, outcome, reason=reason, live_lease=live_lease
        )

    def requeue(
        self,
        entry_id: int,
        token: int,
        *,
        reason: str,
        admit: bool,
        lapsed_before: datetime | None,
        unstarted: bool,
    ) -> bool:
        """Requeue under the pools' locks."""
        return settling.requeue(
            entry_id,
            token,
            reason=reason,
            admit=admit,
            lapsed_before=lapsed_before,
            unstarted=unstarted,
        )

    def admit(self, names: Iterable[str]) -> list[Admission]:
        """An admission pass over ``names`` in its own transaction."""
        return pass_runs.admit(names)

    def wake(self, names: Iterable[str]) -> list[Admission]:
        """A wake-up's pass: the same pass (it waits for the locks)."""
        return pass_runs.admit(names)


#: The ORM engine (it keeps no state).
ORM = OrmEngine()
