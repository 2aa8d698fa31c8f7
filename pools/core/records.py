"""The records that cross layers: what a call submits, what admission hands back.

They live below their users (admission, dispatch, the pg fast path, the Celery gate)
so none of those has to import another to name them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pools.specs import PoolSpec
from pools.states import EntryState, Origin

#: ``reason`` of an entry whose Celery ``expires`` passed while it waited.
EXPIRES = "expired"
#: ``reason`` of an entry whose ``queue_timeout`` passed while it waited.
QUEUE_TIMEOUT = "queue_timeout"
#: ``reason`` of a waiting entry ended because its run spent a budget.
BUDGET = "budget"
#: Key in an entry's ``options`` listing the Celery task ids of the earlier calls a debounced
#: entry collapsed (each gets the run's result: docs/howto/debounce.md).
DEBOUNCED_OPTION = "debounced"
#: Key in an entry's ``options``: the debounce seconds of the entry (explain reads it).
DEBOUNCE_SECONDS_OPTION = "debounce_seconds"
#: Key in an entry's ``options`` naming its run when the run has a budget: the message is
#: published with the ``pools_budget`` header, so the worker measures its task seconds.
BUDGET_OPTION = "budget_run"


@dataclass(frozen=True, kw_only=True)
class BudgetStop:
    """Which budget stopped a run, and the amounts (for :class:`~pools.exceptions.BudgetExceeded`)."""

    run: str
    budget: str
    limit: float
    spent: float


@dataclass(frozen=True, kw_only=True)
class Submission:
    """Everything needed to put one call of a pooled task in line."""

    #: Public key: the Celery task id.
    key: str
    #: Registered Celery task name.
    task_name: str
    #: What the call asks of its pools (after per-call overrides).
    spec: PoolSpec
    #: Positional arguments as shown in the admin and API (JSON data, or Celery's repr of
    #: them when they are not plain JSON); the message itself is in ``options``.
    args: Sequence[Any] | str = ()
    #: Keyword arguments, shown like ``args``.
    kwargs: dict[str, Any] | str = field(default_factory=dict)
    #: Celery publish options held until admission.
    options: dict[str, Any] = field(default_factory=dict)
    #: Earliest admission time (ETA / countdown).
    not_before: datetime | None = None
    #: Celery's ``expires``: the entry ends (as Celery ends an expired task) if still waiting.
    expires: datetime | None = None
    #: Where the call came from.
    origin: Origin = Origin.CODE
    #: Workflow ids.
    root_id: str = ""
    parent_id: str = ""
    #: Celery attempt number (``retries``).
    attempt: int = 0
    #: "Same job" for concurrency policies and superseded retries ("" = none).
    job: str = ""
    #: ``allow``, ``forbid``, ``replace`` or ``skip`` (``ConcurrencyPolicy``).
    concurrency_policy: str = "allow"
    #: A submit whose key matches an unfinished entry returns that entry (None = no key).
    idempotency_key: str | None = None
    #: Node affinity: the Celery hostname that alone may run the entry (empty: any worker).
    pinned_worker: str = ""
    #: Whom the entry is fair to in pools with strategy ``fair`` (empty: the keyless group).
    fairness_key: str = ""
    #: Debounce: seconds of quiet before the one run of ``debounce_key`` starts (None: none).
    debounce: float | None = None
    #: Calls with this key collapse into one waiting entry (docs/howto/debounce.md).
    debounce_key: str | None = None

    @property
    def plain(self) -> bool:
        """No job, policy, key, pinned worker or debounce: the ordinary submit (the
        PostgreSQL fast path's case)."""
        return (
            not self.job
            and self.idempotency_key is None
            and not self.pinned_worker
            and self.debounce_key is None
        )


@dataclass(frozen=True, kw_only=True)
class Admission:
    """An entry that was just admitted: publish its message with this token."""

    entry_id: int
    key: str
    token: int
    task_name: str
    args: list[Any]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    #: Admitted in a pool with a rate: its start confirms its place in the pool's window
    #: of starts (:mod:`pools.core.starts`); the message says so.
    rated: bool = False


@dataclass(frozen=True, kw_only=True)
class Finished:
    """A waiting entry that ended without running (expired, cancelled, rejected)."""

    entry_id: int
    key: str
    task_name: str
    state: EntryState
    pool: str
    deadline: datetime | None
    options: dict[str, Any]
    reason: str
    #: Set when a full backlog's overflow policy dropped the entry: that pool's
    #: ``max_queued`` (its result then fails with :class:`~pools.exceptions.PoolFull`).
    dropped_at: int | None = None
    #: Set when the entry's run spent a budget (its result then fails with
    #: :class:`~pools.exceptions.BudgetExceeded`).
    budget: BudgetStop | None = None


@dataclass(frozen=True, kw_only=True)
class Enqueued:
    """Outcome of :func:`enqueue`."""

    entry_id: int
    key: str
    #: True when the fast path admitted the entry in the submitter's transaction.
    admitted: bool
    #: False when nothing was created: an unfinished entry with the same idempotency key
    #: (or, for ``skip``, of the same job) exists; ``entry_id`` and ``key`` are its.
    created: bool = True
    #: The existing entry's state when ``created`` is False (waiting, admitted, running).
    existing_state: str = ""


@dataclass(frozen=True, kw_only=True)
class Claim:
    """The claim a running task body holds; read it with ``pools.current_claim()``."""

    #: Queue entry id.
    entry_id: int
    #: Fencing token: include it in external writes to reject stale writers.
    token: int
    #: Pools and slots held.
    demand: dict[str, int]
    #: When the lease runs out unless renewed.
    lease_expires_at: datetime
