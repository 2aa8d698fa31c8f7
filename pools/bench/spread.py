"""W7 over several pools (``python -m pools.bench.core --pools K``): which pool each cycle
takes, the pools' rows, and the figures per pool and per database.

With ``K`` pools the ``N`` processes spread their cycles over all of them: cycle ``c`` of
process ``i`` takes pool ``(i + c * N) mod K`` (:func:`pick`). At any one cycle count the
processes are on ``min(N, K)`` different pools, every pool gets the same share of the
cycles, and as the processes drift apart (they do: each waits for its own calls) some of
them meet on one pool, as independent clients would. Each pool has ``N`` slots, like the
one pool of ``K = 1``: a process holds at most one entry at a time, so the slot count never
binds and every enqueue admits at once; what the pools share is the database, and what
each pool's row lock serializes is only its own share of the traffic.

The per-database figures come from the server's side: the CPU of every local PostgreSQL
process (:mod:`pools.bench.cpu`, which also counts other databases' sessions on a shared
server) and the machine's busy share. Through a transaction pooler (PgBouncer) a client's
"own backend" changes from one transaction to the next, so those server-wide figures are
the ones to read there, not W7's per-backend CPU.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

#: Name of W7's one pool (``K = 1``).
POOL = "bench-core"
#: Prefix of the pools of ``K > 1`` (not a prefix of the ballast pool's name).
PREFIX = f"{POOL}-p"
#: Pools listed one by one in the output up to this ``K`` (beyond, min / median / max).
LISTED = 10


def names(pools: int) -> list[str]:
    """The names of W7's ``pools`` pools: the usual one for 1, numbered ones beyond."""
    if pools < 1:
        raise ValueError(f"W7 needs at least one pool, got {pools}")
    if pools == 1:
        return [POOL]
    return [f"{PREFIX}{i:04d}" for i in range(pools)]


def pick(proc: int, cycle: int, procs: int, pools: int) -> int:
    """The pool (index) that cycle ``cycle`` of process ``proc`` of ``procs`` takes.

    ``(proc + cycle * procs) mod pools``: the ``procs`` processes' first cycles go to
    pools ``0 .. procs - 1``, their second ones to the next ``procs`` pools, and so on, so
    ``procs * cycles`` cycles in all give every pool the same count (to within one).
    """
    return (proc + cycle * procs) % pools


def create(pool_names: Sequence[str], slots: int, strategy: str) -> None:
    """Create the numbered pools, each of ``slots`` slots (one statement), and analyze the
    pool table: planned as the table of one or two rows it was, the stored functions'
    cached plans could scan 1,000 pools for each lookup by name."""
    from django.db import connection

    from pools.models import Pool

    Pool.objects.bulk_create([Pool(name=n, slots=slots, strategy=strategy) for n in pool_names])
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE pools_pool")


def delete() -> None:
    """Delete the numbered pools with their entries and events (left by a run)."""
    from django.db import connection

    from pools.models import Pool, PoolEvent

    with connection.cursor() as cursor:
        cursor.execute(
            "WITH gone AS (DELETE FROM pools_demand d USING pools_pool p "
            "WHERE p.id = d.pool_id AND p.name LIKE %s RETURNING d.entry_id) "
            "DELETE FROM pools_queueentry WHERE queue_id IN (SELECT entry_id FROM gone)",
            [PREFIX + "%"],
        )
    PoolEvent.objects.filter(pool__startswith=PREFIX).delete()
    Pool.objects.filter(name__startswith=PREFIX).delete()


def per_pool(pool_names: Sequence[str], seconds: float) -> dict[str, Any]:
    """Admissions per second of each pool over ``seconds`` (its ``admissions`` counter).

    Up to :data:`LISTED` pools each by name; beyond, their min, median and max.
    """
    from pools.models import Pool

    counts = dict(Pool.objects.filter(name__in=pool_names).values_list("name", "admissions"))
    # Three significant digits: 1,000 pools share a few hundred admissions per second.
    rates = {n: float(f"{counts.get(n, 0) / seconds:.3g}") for n in pool_names}
    values = sorted(rates.values())
    out: dict[str, Any] = {
        "per_pool_admissions_per_s_min": values[0],
        "per_pool_admissions_per_s_median": statistics.median(values),
        "per_pool_admissions_per_s_max": values[-1],
        "pools_without_admissions": sum(1 for v in values if v == 0),
    }
    if len(pool_names) <= LISTED:
        out["per_pool_admissions_per_s"] = rates
    return out


def server_figures(
    before: Mapping[str, float] | None,
    after: Mapping[str, float] | None,
    tasks: int,
    share: Mapping[str, float] | None,
) -> dict[str, Any]:
    """CPU ms per task of every local PostgreSQL process and of the machine, its busy share."""
    from pools.bench import cpu

    spent = cpu.per_task_ms(before, after, tasks) or {}
    return {
        "postgres_cpu_ms_per_task": spent.get("postgres"),
        "machine_cpu_ms_per_task": spent.get("machine"),
        "machine_busy_percent": None if share is None else share["busy_percent"],
    }
