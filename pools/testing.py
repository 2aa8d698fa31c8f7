"""Helpers for testing your own pooled tasks (and for this project's fault tests)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime

from pools.celery.keeper import keeper
from pools.core import admission, spendcap, sweeps
from pools.core.snapshots import PoolSnapshot, snapshot


def simulate_partition(on: bool = True) -> None:
    """Make this process's lease renewals fail as if the database were unreachable.

    Call it inside a pooled task body to watch the body receive ``LeaseLost``
    before its lease lapses.
    """
    keeper.partitioned = on


def sweep() -> sweeps.SweepReport:
    """Run one sweep pass now (what celery-beat runs every few seconds)."""
    return sweeps.sweep()


def admit(*pools: str) -> int:
    """Run an admission pass over ``pools``; returns how many entries were admitted."""
    return len(admission.admit(pools))


def pool_state(name: str) -> PoolSnapshot:
    """Snapshot of one pool (held, waiting, head of line)."""
    return snapshot(name)


@contextmanager
def spend_clock(now: datetime | Callable[[], datetime]) -> Iterator[None]:
    """Make the daily spend caps read the day from ``now`` (a time, or a callable) in the block.

    ``with spend_clock(datetime(2026, 1, 1, 23, 59, tzinfo=UTC)): ...``; pass a callable to
    move the clock inside the block.
    """
    before = spendcap.clock
    spendcap.clock = now if callable(now) else (lambda: now)
    try:
        yield
    finally:
        spendcap.clock = before
