"""Head eligibility: may a waiting entry that is first in line be admitted now?

An entry that fits can still be *ineligible* (see docs/reference/pool-policies.md,
Ineligible heads): its pool is paused (decided by the pass itself), its ``concurrency_policy`` is ``forbid`` and another instance of its job
is admitted or running, or it is pinned to a worker that has no live heartbeat. An
ineligible head still blocks the lower entries of its pool (head-of-line), like a head
that waits for slots.

Both admission paths decide this here, once: the fast-path functions report such heads
as 'fallback' (``pools/pg/sql/schema.sql``) and the Python pass asks :func:`blocker`. Read-only:
the caller holds the locks of the entry's pools.

Exactness of ``forbid``: the check reads the other instances of the job under the locks
of the head's pools, so it is exact for instances that share a pool with it (every
instance of one task does, unless a call overrides its pools); an instance in disjoint
pools is seen as of the last commit.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from pools.core import nodes
from pools.models import QueueEntry
from pools.states import HELD_STATES, ConcurrencyPolicy

#: ``blocked_by`` of a ``forbid`` head while another instance of its job holds slots.
FORBID = "forbid"
#: ``blocked_by`` of a head pinned to a worker without a live heartbeat.
WORKER_UNAVAILABLE = "worker_unavailable"


@dataclass(frozen=True, kw_only=True)
class Blocker:
    """Why a head is ineligible."""

    #: :data:`FORBID` or :data:`WORKER_UNAVAILABLE`.
    kind: str
    #: One human sentence.
    message: str
    #: Machine-readable detail: ``job`` and ``holder``, or ``worker``.
    detail: dict[str, Any] = field(default_factory=dict)


def is_special(entry: QueueEntry) -> bool:
    """True when the entry may be an ineligible head (the fast path hands it over)."""
    return bool(entry.pinned_worker) or (
        entry.concurrency_policy == ConcurrencyPolicy.FORBID and bool(entry.job)
    )


def held_instance(job: str, *, besides: int) -> QueueEntry | None:
    """An admitted or running entry of ``job`` other than ``besides``, if any."""
    return (
        QueueEntry.objects.filter(job=job, finished_at__isnull=True, state__in=HELD_STATES)
        .exclude(pk=besides)
        .only("queue_id", "key", "state", "job")
        .order_by("queue_id")
        .first()
    )


def blocker(
    entry: QueueEntry,
    *,
    live: Callable[[], Collection[str]] = nodes.live_hostnames,
    admitted_jobs: Collection[str] = (),
) -> Blocker | None:
    """Why the head ``entry`` cannot be admitted now, or ``None`` if nothing but slots stop it.

    ``live`` gives the hostnames with a live heartbeat (called only for a pinned entry);
    ``admitted_jobs`` are the jobs of entries admitted earlier in the same pass (not
    written yet).
    """
    if entry.concurrency_policy == ConcurrencyPolicy.FORBID and entry.job:
        if entry.job in admitted_jobs:
            return Blocker(
                kind=FORBID,
                message=f"Another instance of job {entry.job!r} was just admitted "
                f"(concurrency_policy='forbid'): it waits until that one finishes.",
                detail={"job": entry.job},
            )
        other = held_instance(entry.job, besides=entry.queue_id)
        if other is not None:
            return Blocker(
                kind=FORBID,
                message=f"Job {entry.job!r} is already {other.state} as #{other.queue_id} "
                f"(concurrency_policy='forbid'): it waits until that one finishes.",
                detail={
                    "job": entry.job,
                    "holder": {"queue_id": other.queue_id, "key": other.key, "state": other.state},
                },
            )
    if entry.pinned_worker and entry.pinned_worker not in live():
        return Blocker(
            kind=WORKER_UNAVAILABLE,
            message=f"Pinned to worker {entry.pinned_worker!r}, which has no live heartbeat: "
            f"it waits until that worker is back (or its deadline passes).",
            detail={"worker": entry.pinned_worker},
        )
    return None
