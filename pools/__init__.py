"""django-celery-pools: named resource pools with a global concurrency limit for Celery tasks.

Import-safe: nothing here touches models or the database at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pools.exceptions import (
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
    PoolRefused,
    PoolUnavailable,
    QueueTimeout,
    UnknownPool,
    UnserializableArguments,
)

if TYPE_CHECKING:
    from pools.core.leases import Claim
    from pools.models import QueueEntry

__version__ = "0.1.0"

__all__ = [
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
    "PoolRefused",
    "PoolUnavailable",
    "QueueTimeout",
    "UnknownPool",
    "UnserializableArguments",
    "__version__",
    "cancel",
    "current_claim",
    "pooled",
    "snapshot",
]


def pooled(*args: Any, **kwargs: Any) -> Any:
    """Limit a Celery task by named resource pools; see :func:`pools.celery.decorators.pooled`."""
    from pools.celery.decorators import pooled as _pooled

    return _pooled(*args, **kwargs)


def cancel(key: str, *, terminate: bool = False) -> QueueEntry:
    """Cancel the waiting entry with ``key`` (a Celery task id); see :func:`pools.core.admission.cancel`."""
    from pools.core import admission

    return admission.cancel(key, terminate=terminate)


def current_claim() -> Claim | None:
    """The claim (entry id, fencing token, lease) of the pooled task running in this thread."""
    from pools.celery import worker

    return worker.current_claim()


def snapshot(name: str) -> Any:
    """A point-in-time view of pool ``name``; see :func:`pools.core.snapshots.snapshot`."""
    from pools.core import snapshots

    return snapshots.snapshot(name)
