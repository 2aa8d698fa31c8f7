"""django-celery-pools: named resource pools with a global concurrency limit for Celery tasks.

Import-safe: nothing here touches models or the database at import time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from pools.exceptions import (
    Backoff,
    BackoffLimitExceeded,
    BudgetExceeded,
    DemandExceedsCapacity,
    EntryNotFound,
    JobNotFound,
    LeaseLost,
    MessageTooLarge,
    NotCancellable,
    PoolConfigurationError,
    PoolDefinedInSettings,
    PoolDraining,
    PoolError,
    PoolFull,
    PoolInUse,
    PoolKeyError,
    PoolPaused,
    PoolRefused,
    PoolUnavailable,
    QueueTimeout,
    UnknownPool,
    UnserializableArguments,
)
from pools.specs import PoolSpec, with_arguments_of

if TYPE_CHECKING:
    from pools.core.budgets import Charged, Spend
    from pools.core.leases import Claim
    from pools.core.snapshots import PoolSnapshot
    from pools.models import QueueEntry

T = TypeVar("T")

__version__ = "0.1.0"

__all__ = [
    "Backoff",
    "BackoffLimitExceeded",
    "BudgetExceeded",
    "DemandExceedsCapacity",
    "EntryNotFound",
    "JobNotFound",
    "LeaseLost",
    "MessageTooLarge",
    "NotCancellable",
    "PoolConfigurationError",
    "PoolDefinedInSettings",
    "PoolDraining",
    "PoolError",
    "PoolFull",
    "PoolInUse",
    "PoolKeyError",
    "PoolPaused",
    "PoolRefused",
    "PoolUnavailable",
    "QueueTimeout",
    "UnknownPool",
    "UnserializableArguments",
    "__version__",
    "cancel",
    "charge",
    "current_claim",
    "enqueue_many",
    "limit_run",
    "pooled",
    "run_spend",
    "snapshot",
]


@with_arguments_of(PoolSpec.build)
def pooled(*args: Any, **options: Any) -> Callable[[T], T]:
    """Limit a Celery task by named resource pools; see :func:`pools.celery.decorators.pooled`.

    ``@pooled("warehouse", slots=2, priority=10, queue_timeout=1800)`` or
    ``@pooled({"warehouse": 1, "partner-api": 1})``; arguments are checked at once.
    ``concurrency_policy`` (``allow``, ``forbid``, ``replace``, ``skip``), ``job_key`` and
    ``idempotency_key`` (callables of the task's arguments): see the job policies how-to.
    ``max_running=N``: a task cap, at most N calls of the task admitted at once.
    ``fairness_key`` (a string, or a callable of the task's arguments): whom a call is
    fair to in pools with strategy ``fair``.
    ``rate="20/s"`` (or a list such as ``["10/s", "100000/d"]``): a task rate, at most that
    many calls of the task started per sliding window across every worker.
    """
    from pools.celery.decorators import pooled as _pooled

    return _pooled(*args, **options)


def limit_run(
    signature: Any,
    *,
    max_running: int | None = None,
    budget: Mapping[str, Any] | None = None,
    **options: Any,
) -> Any:
    """Send a workflow as one run with a run cap (``max_running``), a budget, or both;
    see :func:`pools.celery.caps.limit_run`."""
    from pools.celery import caps

    return caps.limit_run(signature, max_running=max_running, budget=budget, **options)


def cancel(key: str, *, terminate: bool = False) -> QueueEntry:
    """Cancel the waiting entry with ``key`` (a Celery task id); see :func:`pools.core.admission.cancel`."""
    from pools.core import admission

    return admission.cancel(key, terminate=terminate)


def enqueue_many(calls: Iterable[Any], *, app: Any = None) -> list[Any]:
    """Send many pooled calls in one transaction; their ``AsyncResult`` in order.

    ``calls``: signatures (``task.s(1, 2)``) or ``(task, args[, kwargs[, options]])``
    tuples. Atomic like ``bulk_create``: one refusal (``PoolFull``, ``UnknownPool``, ...)
    and none is enqueued. See :func:`pools.celery.fanout.enqueue_many` and
    docs/howto/fan-out.md.
    """
    from pools.celery import fanout

    return fanout.enqueue_many(calls, app=app)


def current_claim() -> Claim | None:
    """The claim (entry id, fencing token, lease) of the pooled task running in this thread."""
    from pools.celery import worker

    return worker.current_claim()


def snapshot(name: str) -> PoolSnapshot:
    """A point-in-time view of pool ``name``; see :func:`pools.core.snapshots.snapshot`."""
    from pools.core import snapshots

    return snapshots.snapshot(name)


def charge(*, cost: float = 0, tokens: int = 0) -> Charged | None:
    """Charge the running pooled task's run; see :func:`pools.celery.budgets.charge`."""
    from pools.celery import budgets

    return budgets.charge(cost=cost, tokens=tokens)


def run_spend(run_id: str) -> Spend | None:
    """A run's budget and spend so far (``None`` without a budget)."""
    from pools.core import budgets

    return budgets.spend(run_id)
