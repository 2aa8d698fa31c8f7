"""The end of a backoff (:mod:`pools.core.backoffs`): resume a locked pool, with an event.

Kept apart from :mod:`pools.core.backoffs` because the admission pass calls it (the pass
resumes a pool whose ``backoff_until`` has come) and that module runs passes.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from pools.core import events
from pools.models import Pool
from pools.states import EventKind


def ended(now: datetime) -> list[str]:
    """The pools whose backoff has ended by ``now``, by name: a pass over them resumes
    them (:func:`end_due_locked`). Only a backoff sets ``backoff_until``, and every resume
    clears it (the stored functions hand such a pool to that pass: ``schema.sql``)."""
    query = Pool.objects.filter(backoff_until__lte=now)
    return list(query.order_by("name").values_list("name", flat=True))


def end_due_locked(pools: Iterable[Pool], now: datetime) -> list[str]:
    """Resume the locked pools whose backoff has ended (called by the admission pass)."""
    ended = [p for p in pools if p.backoff_until is not None and p.backoff_until <= now]
    for pool in ended:
        resume(pool, now, reason="ended")
    return [p.name for p in ended]


def resume(pool: Pool, now: datetime, *, reason: str, actor: str | None = None) -> None:
    """Resume a locked pool in backoff (``reason``: ``ended`` at its time, or ``early``)."""
    until = pool.backoff_until
    pool.paused, pool.backoff_until = False, None
    pool.save(update_fields=["paused", "backoff_until", "updated_at"])
    events.record_pool(
        EventKind.BACKOFF,
        pool.name,
        at=now,
        detail={"ended": reason, "until": until.isoformat() if until else None},
        actor=actor,
    )
