"""Hands admitted entries (and entries that ended while waiting) to the task runner.

The core does not know Celery: it calls the *bridge* named by ``POOLS["PUBLISHER"]``
(by default :mod:`pools.celery.bridge`) after the admitting transaction commits, so a
message is never published for a claim that was rolled back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Protocol

from django.db import transaction
from django.utils import timezone
from django.utils.module_loading import import_string

from pools import conf
from pools.core.records import Admission, Finished

logger = logging.getLogger("pools.core.dispatch")

#: Puts an admitted entry whose message was not handed to the broker back in line.
Requeue = Callable[[Admission, str], None]


class Bridge(Protocol):
    """What the core needs from a task runner."""

    def publish(self, admissions: Sequence[Admission]) -> None:
        """Publish the message of each admitted entry with its fencing token."""

    def report_finished(self, finished: Sequence[Finished]) -> None:
        """Record the outcome of entries that ended without running (expired, cancelled)."""

    def terminate(self, key: str) -> None:
        """Stop the admitted or running task ``key`` wherever it is."""

    def wake_at(self, pools: Sequence[str], when: datetime) -> None:
        """Run an admission pass over ``pools`` at ``when`` (a head's ``not_before``)."""


def bridge() -> Bridge:
    """The configured bridge object (a module or an object with the two methods)."""
    target: Bridge = import_string(conf.get().PUBLISHER)
    return target


def _now(func: Callable[[], None]) -> None:
    func()


def after_commit(
    admissions: Sequence[Admission],
    finished: Sequence[Finished],
    wake: dict[str, datetime] | None = None,
    *,
    committed: bool = False,
    requeue: Requeue,
) -> None:
    """Schedule publishing/reporting (and timed wake-ups) for when the transaction commits.

    ``committed=True``: the work was committed on another connection (pools' own, see
    :mod:`pools.pg.fastpath`); run it now.

    Nothing here fails the caller, whose change has committed: if publishing raises
    (the bridge could not even start), each admission is handed to ``requeue`` at once,
    so its entry waits in line again instead of holding slots until its lease lapses.
    """
    run = _now if committed else transaction.on_commit
    if admissions:
        run(lambda: _publish(admissions, requeue))
    if finished:
        run(lambda: _guarded("reporting ended entries", lambda: bridge().report_finished(finished)))
    due = {pool: when for pool, when in (wake or {}).items() if _should_wake(pool, when)}
    if due:
        run(lambda: _guarded("scheduling wake-ups", lambda: _wake(due)))


def _publish(admissions: Sequence[Admission], requeue: Requeue) -> None:
    try:
        bridge().publish(admissions)
    except Exception as exc:
        logger.exception("Publishing %d admitted entries failed; requeueing them", len(admissions))
        for adm in admissions:
            requeue(adm, f"publish failed: {exc}")


def _guarded(what: str, func: Callable[[], None]) -> None:
    try:
        func()
    except Exception:
        logger.exception("After-commit work failed: %s", what)


def wake(pools: Sequence[str], when: datetime) -> None:
    """Ask the bridge for an admission pass over ``pools`` at ``when`` (not on commit)."""
    due = {pool: when for pool in pools if _should_wake(pool, when)}
    if due:
        _guarded("scheduling wake-ups", lambda: _wake(due))


def _wake(due: dict[str, datetime]) -> None:
    target = bridge()
    wake_at = getattr(target, "wake_at", None)  # optional for custom bridges
    if wake_at is not None:
        for pool, when in due.items():
            wake_at([pool], when)


#: Wake-ups already scheduled by this process: pool -> time.
_scheduled: dict[str, datetime] = {}
#: Heads further away than this are left to the sweep (broker ETAs stay short).
WAKE_HORIZON = timedelta(minutes=5)


def _should_wake(pool: str, when: datetime) -> bool:
    """One timer per pool and time per process; far-off heads are the sweep's job."""
    now = timezone.now()
    if when - now > WAKE_HORIZON:
        return False
    known = _scheduled.get(pool)
    if known is not None and now < known <= when:
        return False  # an earlier wake-up is pending; it will schedule the next one
    _scheduled[pool] = when
    return True
