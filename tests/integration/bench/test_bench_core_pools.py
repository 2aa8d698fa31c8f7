"""W7 (``python -m pools.bench.core``) in miniature, on PostgreSQL: ``--pools K`` spreads the
cycles over ``K`` pools, every pool admits its share, each process holds one connection,
and without the option the output is W7's usual one. Counts, never timings."""

from __future__ import annotations

import pytest

from pools.bench import core, spread, w7_tables
from pools.models import Pool, QueueEntry
from pools.states import EntryState

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

#: The keys W7 printed per run before ``--pools`` (kept without the option).
USUAL = {
    "procs",
    "strategy",
    "depth",
    "rate",
    "connection",
    "tasks",
    "seconds",
    "admissions_per_s",
    "lock_call_ms_p50",
    "lock_call_ms_p99",
    "wal_bytes_per_task",
    "client_cpu_ms_per_task",
    "backend_cpu_ms_per_task",
}


def test_run_once__pools_spreads_the_cycles_over_every_pool() -> None:
    figures = core.run_once(3, 24, pools=4)
    assert figures["tasks"] == 24 and figures["pools"] == 4 and figures["slots_per_pool"] == 3
    names = spread.names(4)
    # Each pool admitted its share (24 cycles over 4 pools), by its own counter.
    assert dict(Pool.objects.filter(name__in=names).values_list("name", "admissions")) == {
        n: 6 for n in names
    }
    done = QueueEntry.objects.filter(demands__pool__name__in=names, state=EntryState.SUCCEEDED)
    assert done.count() == 24
    assert not Pool.objects.filter(name=spread.POOL).exists()
    assert figures["pools_without_admissions"] == 0
    assert set(figures["per_pool_admissions_per_s"]) == set(names)
    assert figures["per_pool_admissions_per_s_min"] > 0
    # One connection per process: its own (Django's is closed before the clock starts).
    assert figures["connections_per_process"] == 1
    assert figures["postgres_cpu_ms_per_task"] is not None


def test_run_once__without_pools_prints_the_usual_figures_on_one_pool() -> None:
    figures = core.run_once(2, 8)
    assert set(figures) == USUAL
    assert figures["tasks"] == 8
    assert Pool.objects.get(name=spread.POOL).admissions == 8


def test_run_once__one_pool_given_adds_the_figures_on_the_usual_pool() -> None:
    figures = core.run_once(2, 8, pools=1)
    assert USUAL < set(figures)
    assert figures["per_pool_admissions_per_s"].keys() == {spread.POOL}
    assert figures["connections_per_process"] == 1


def test_reset__deletes_the_numbered_pools_and_their_entries() -> None:
    core.run_once(2, 8, pools=4)
    w7_tables.reset(ballast=False)
    assert not Pool.objects.filter(name__startswith=spread.PREFIX).exists()
    assert not QueueEntry.objects.exists()


@pytest.mark.parametrize("mode", ["wake", "pass"])
def test_run_once__wakers_run_beside_w7_and_every_task_still_succeeds(mode: str) -> None:
    """``--wakers``: their passes may admit W7's entries (taking a release left while they
    held the lock); they run those as W7 does, so every task succeeds and none is left."""
    figures = core.run_once(2, 40, wake=(2, mode, 5.0))
    assert USUAL < set(figures)
    assert figures["wakers"] == 2 and figures["wake_mode"] == mode
    assert figures["wake_calls"] >= 2  # each waker called at least once before W7 ended
    assert Pool.objects.get(name=spread.POOL).admissions == 40
    ours = QueueEntry.objects.filter(demands__pool__name=spread.POOL)
    assert ours.filter(state=EntryState.SUCCEEDED).count() == 40


def test_run_once__a_rated_pool_starts_each_task_through_its_window_of_starts() -> None:
    """``--rate``: W7 starts what a rated pool admitted as a worker does (``start_rated``),
    so the rate's cost includes the start's check (the pool's ``starts`` counter)."""
    figures = core.run_once(2, 8, rate=["100000/s"])
    assert figures["tasks"] == 8
    pool = Pool.objects.get(name=spread.POOL)
    assert (pool.admissions, pool.starts) == (8, 8)
    done = QueueEntry.objects.filter(demands__pool__name=spread.POOL, state=EntryState.SUCCEEDED)
    assert done.count() == 8
