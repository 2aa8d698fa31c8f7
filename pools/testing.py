"""Helpers for testing your own pooled tasks (and for this project's fault tests)."""

from __future__ import annotations

from pools.celery.keeper import keeper
from pools.core import admission, sweeps
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
