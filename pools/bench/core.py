"""W7: the admission core alone (no broker), and what one pooled task costs the database.

Run against a scratch PostgreSQL database (tables created by ``migrate``)::

    POOLS_TEST_DB=postgres POOLS_PG_NAME=pools_bench DJANGO_SETTINGS_MODULE=tests.settings \\
        python -m pools.bench.core [--procs 1,4,16] [--cycles 2000] [--reps 3]
            [--strategy priority|fifo|lifo|fair] [--depths 0,10000,100000] [--rate 100000/s]

``N`` processes (``--procs``) each run ``--cycles / N`` times *enqueue -> start -> settle*
on one pool of ``N`` slots, through the public service functions (``admission.enqueue``,
``leases.start``, ``admission.settle``), with a bridge that publishes nothing: an admitted
entry is handed to the process whose call admitted it (its enqueue, or the settle that
freed the slot), which then starts and settles it, as a worker would. Nothing else runs
in those processes, so the figures are the admission core's own: how many admissions one
pool sustains on one PostgreSQL.

Printed as JSON, per ``N``: admissions/s (median of the repetitions, min and max), the
time each locking call (enqueue, settle) took as seen by its caller, p50 / p99 — an upper
bound of the time the pool's row lock was held per admission, which is at most that of
one call — WAL bytes per task (of this database only when the ``pg_walinspect``
extension is installed in it, see :func:`pools.bench.database.wal_bytes_since`) and CPU ms
per task of the client processes and of their PostgreSQL backends (``/proc``). The pool and its entries are deleted at the end.

``--strategy`` gives the pool a strategy (the timed tasks of a ``fair`` pool cycle over
100 fairness keys). ``--depths`` runs everything again with that many entries already
waiting in the pool's line, placed behind every round and priority the run reaches (as
W3 does for the whole stack): the admission cost should not grow with the line.

``--pools K`` (e.g. ``--pools 1,10,100,1000``) spreads the ``N`` processes over ``K``
pools of ``N`` slots each, so that no slot count binds: cycle ``c`` of process ``i`` takes
pool ``(i + c * N) mod K`` (:mod:`pools.bench.spread`). Besides the figures above it prints
admissions/s per pool (each pool's by name up to 10 pools, else min / median / max), the CPU
per task of every local PostgreSQL process and the machine's busy share (the database's
side, and the figures that stay right through PgBouncer), and the connections each process
held (one: its own; Django's, opened once to choose the engine, is closed before the
clock starts). Without ``--pools`` the output is W7's usual one. Each process holds one
connection, so ``N`` processes need ``N`` (plus one for this script between runs) of the
server's ``max_connections``; behind PgBouncer in transaction mode they share its pool.

``--rate`` gives the pool a rate (``"N/s|m|h|d"``, or several separated by commas): with
one no run reaches (``100000/s``) every admission and every start checks and records it
(a start as a worker makes it: ``leases.start_rated``, under the pool's lock) but none is
refused, so the figures beside a run without ``--rate`` are what the rate checks cost.

``--wakers K`` runs K more processes that each run a timed wake-up's admission of the pool
every ``--wake-every`` ms, in bursts of K (:mod:`pools.bench.wakers`); ``--wake-mode pass``
makes them the Python pass a wake-up ran before 0.2.0. It adds the wake-ups' count and
time per call to the figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from pools.bench import spread, w7_tables
from pools.bench import wakers as wakers_mod

#: Name of the pool this script creates (and deletes); with ``--pools K``, K pools
#: (:mod:`pools.bench.spread`).
POOL = spread.POOL

_admitted: list[Any] = []


class CollectingBridge:
    """Keeps each admission for the process whose call admitted it; publishes nothing."""

    def publish(self, admissions: Sequence[Any]) -> None:
        """Hand admitted entries to this process's loop."""
        _admitted.extend(admissions)

    def report_finished(self, finished: Sequence[Any]) -> None:
        """Nothing ends while waiting here."""

    def wake_at(self, pools: Sequence[str], when: Any) -> None:
        """No timed wake-ups."""

    def terminate(self, key: str) -> None:
        """Nothing to stop."""


bridge = CollectingBridge()
#: The setting that names :data:`bridge` (W7's processes and the wakers publish through it).
PUBLISHER = "pools.bench.core.bridge"


def _ticks(pid: int) -> int:
    """User + system clock ticks of a process (0 where ``/proc`` is missing)."""
    try:
        raw = open(f"/proc/{pid}/stat").read()
    except OSError:
        return 0
    fields = raw[raw.rfind(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


def _backend_pid() -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return int(cursor.fetchone()[0])


#: Fairness keys the timed tasks of a ``fair`` pool cycle over.
KEYS = 100


def _worker(
    cycles: int,
    own: bool,
    barrier: Any,
    out: Any,
    index: int = 0,
    procs: int = 1,
    pool_names: Sequence[str] = (POOL,),
) -> None:
    """One process (``index`` of ``procs``): ``cycles`` enqueues, each on the pool
    :func:`pools.bench.spread.pick` gives it, and start + settle of whatever it admitted."""
    import django

    django.setup()
    from django.db import connection
    from django.test.utils import override_settings

    from pools.bench import core  # this module under its own name (not ``__main__``)
    from pools.core import admission, leases
    from pools.core import engine as engines
    from pools.core.records import Claim, Submission
    from pools.pg import fastpath
    from pools.specs import PoolSpec

    if own:
        fastpath.use_own_connection()
    specs = [PoolSpec.build(name, 1) for name in pool_names]
    lock_calls: list[float] = []
    backend = fastpath.own_backend_pid() if own else _backend_pid()
    if own:
        # The engine is chosen once per process, with a catalog query on Django's
        # connection (unless the choice came through the fork), which would then stay open
        # and idle: close it, as Celery's Django fixup does after each task, so that each
        # process holds one connection (its own), not two.
        engines.engine()
        connection.close()
    backend_ticks = _ticks(backend)
    own_ticks = _ticks(os.getpid())
    worker = f"w7-{os.getpid()}"
    with override_settings(POOLS={"PUBLISHER": PUBLISHER}):
        barrier.wait()  # every process connected: the parent reads the CPU counters
        barrier.wait()  # and starts the clock
        for i in range(cycles):
            t0 = time.perf_counter()
            admission.enqueue(
                Submission(
                    key=str(uuid.uuid4()),
                    task_name="w7.noop",
                    spec=specs[spread.pick(index, i, procs, len(specs))],
                    args=[],
                    fairness_key=f"t{(os.getpid() + i) % KEYS}",
                )
            )
            lock_calls.append(time.perf_counter() - t0)
            while core._admitted:
                adm = core._admitted.pop(0)
                # As a worker starts it: through the pool's window of starts when rated.
                start = leases.start_rated if adm.rated else leases.start
                claim = start(adm.entry_id, adm.token, worker=worker)
                if not isinstance(claim, Claim):
                    raise RuntimeError(f"W7: start of entry {adm.entry_id} refused: {claim!r}")
                t0 = time.perf_counter()
                if not admission.settle(adm.entry_id, adm.token, "succeeded", live_lease=True):
                    raise RuntimeError(f"W7: settle of entry {adm.entry_id} refused")
                lock_calls.append(time.perf_counter() - t0)
    out.put(
        {
            "lock_calls": lock_calls,
            "client_ticks": _ticks(os.getpid()) - own_ticks,
            "backend_ticks": _ticks(backend) - backend_ticks,
            # connections this process held: pools' own and / or Django's
            "connections": int(own) + int(connection.connection is not None),
        }
    )
    try:  # keep the connection (its backend's CPU) until the parent has read the counters
        barrier.wait(timeout=60)
    except threading.BrokenBarrierError:
        pass


def run_once(
    procs: int,
    cycles: int,
    own: bool = True,
    *,
    strategy: str = "priority",
    depth: int = 0,
    rate: list[str] | None = None,
    pools: int | None = None,
    wake: tuple[int, str, float] = (0, "wake", 0.0),
) -> dict[str, Any]:
    """One repetition with ``procs`` processes and ``cycles`` tasks in all.

    ``wake``: ``(K, mode, every_ms)``, K processes of timed wake-ups beside them
    (:mod:`pools.bench.wakers`); K = 0, none.

    ``pools``: spread the cycles over that many pools (:mod:`pools.bench.spread`) and add
    the per-pool and per-database figures; ``None`` is one pool and the figures W7 always
    printed.
    """
    from django.db import connections

    from pools.bench import cpu
    from pools.models import Pool, QueueEntry
    from pools.states import EntryState

    pool_names = spread.names(pools or 1)
    if depth and len(pool_names) > 1:
        raise ValueError("W7: --depths fills one pool's line; use it with one pool")
    w7_tables.reset()
    if len(pool_names) > 1:
        spread.create(pool_names, procs, strategy)
    else:
        Pool.objects.create(name=POOL, slots=procs + 1, strategy=strategy, paused=True)
    if rate:
        from pools.bench import rates

        for name in pool_names:
            rates.set_rate(name, rate if len(rate) > 1 else rate[0])
    if depth:
        w7_tables.fill(depth, procs)
    Pool.objects.filter(name=POOL).update(slots=procs, paused=False)
    connections.close_all()  # the children open their own
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(procs + 1)
    out = ctx.Queue()
    each = max(cycles // procs, 1)
    children = [
        ctx.Process(target=_worker, args=(each, own, barrier, out, i, procs, pool_names))
        for i in range(procs)
    ]
    wakers, wake_mode, wake_every = wake
    # This module under its own name (not ``__main__``), whose list the bridge fills.
    from pools.bench import core as named

    stop, wake_out = ctx.Event(), ctx.Queue()
    waking = [
        ctx.Process(
            target=wakers_mod.waker,
            args=(POOL, wake_mode, wake_every, stop, wake_out, PUBLISHER, named._admitted),
        )
        for _ in range(wakers)
    ]
    for child in [*children, *waking]:
        child.start()
    from pools.bench import database

    wal0 = database.wal_position()
    connections.close_all()
    barrier.wait()  # every child has its connection
    cpu0, machine0 = cpu.snapshot(()), cpu.machine_counters()
    barrier.wait()
    t0 = time.perf_counter()
    results = [out.get(timeout=600) for _ in children]
    elapsed = time.perf_counter() - t0
    stop.set()
    woken = [wake_out.get(timeout=60) for _ in waking]
    for child in waking:
        child.join()
    cpu1, share = cpu.snapshot(()), cpu.machine_share(machine0)
    barrier.wait()  # the children may now close their connections and exit
    for child in children:
        child.join()
    wal = database.wal_bytes_since(wal0)
    total = each * procs
    ours = QueueEntry.objects.filter(demands__pool__name__in=pool_names)
    done = ours.filter(state=EntryState.SUCCEEDED).count()
    if done != total:
        raise RuntimeError(f"W7: {done} of {total} entries succeeded")
    waiting = ours.filter(state=EntryState.WAITING).count()
    if waiting != depth:
        raise RuntimeError(f"W7: {waiting} entries wait at the end, not the {depth} filled in")
    calls = sorted(c for r in results for c in r["lock_calls"])
    hz = os.sysconf("SC_CLK_TCK")
    figures: dict[str, Any] = {
        "procs": procs,
        "strategy": strategy,
        "depth": depth,
        "rate": rate,
        "connection": "own" if own else "django",
        "tasks": total,
        "seconds": round(elapsed, 3),
        "admissions_per_s": round(total / elapsed, 1),
        "lock_call_ms_p50": round(1000 * calls[len(calls) // 2], 3),
        "lock_call_ms_p99": round(1000 * calls[int(len(calls) * 0.99)], 3),
        "wal_bytes_per_task": None if wal is None else round(wal / total, 1),
        "client_cpu_ms_per_task": round(
            1000 * sum(r["client_ticks"] for r in results) / hz / total, 3
        ),
        "backend_cpu_ms_per_task": round(
            1000 * sum(r["backend_ticks"] for r in results) / hz / total, 3
        ),
    }
    if wakers:
        figures.update(wakers_mod.figures(woken, wake_mode, wake_every))
    if pools is None:
        return figures
    return {
        **figures,
        "pools": len(pool_names),
        "slots_per_pool": procs,
        "connections_per_process": max(r["connections"] for r in results),
        **spread.per_pool(pool_names, elapsed),
        **spread.server_figures(cpu0, cpu1, total, share),
    }


def _repeat(
    opts: argparse.Namespace, procs: int, depth: int, rate: list[str] | None, pools: int | None
) -> dict[str, Any]:
    """``--reps`` runs of one point: the median run's figures, with the min and max rate."""
    runs = [
        run_once(
            procs,
            opts.cycles,
            opts.connection == "own",
            strategy=opts.strategy or "priority",
            depth=depth,
            rate=rate,
            pools=pools,
            wake=(opts.wakers, opts.wake_mode, opts.wake_every),
        )
        for _ in range(opts.reps)
    ]
    rates = [r["admissions_per_s"] for r in runs]
    mid = sorted(runs, key=lambda r: r["admissions_per_s"])[len(runs) // 2]
    return {
        **mid,
        "admissions_per_s_min": min(rates),
        "admissions_per_s_max": max(rates),
        "admissions_per_s_median": statistics.median(rates),
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the options, run W7 and print the figures as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--procs", default="1,4,16")
    parser.add_argument("--cycles", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--connection",
        choices=["own", "django"],
        default="own",
        help="pools' own prepared connection (as in workers) or Django's (default: own)",
    )
    parser.add_argument("--strategy", choices=["priority", "fifo", "lifo", "fair"])
    parser.add_argument("--depths", default="0", help="entries already waiting, e.g. 0,100000")
    parser.add_argument(
        "--rate", default=None, help="the pool's rate(s), e.g. 100000/s (one that never binds)"
    )
    parser.add_argument(
        "--pools",
        default=None,
        help="spread the processes over K pools of N slots each, e.g. 1,10,100,1000; adds "
        "admissions/s per pool and the database's CPU (default: one pool, the usual figures)",
    )
    parser.add_argument(
        "--wakers",
        type=int,
        default=0,
        help="K processes of timed wake-ups of the pool beside W7's (pools.bench.wakers)",
    )
    parser.add_argument("--wake-mode", choices=wakers_mod.MODES, default="wake")
    parser.add_argument(
        "--wake-every", type=float, default=20.0, help="ms between the wakers' bursts"
    )
    opts = parser.parse_args(argv)
    if opts.wakers and opts.pools is not None:
        parser.error("--wakers wakes W7's one pool: use it without --pools")
    rate = [r.strip() for r in opts.rate.split(",") if r.strip()] if opts.rate else None
    depths = [int(d) for d in opts.depths.split(",")]
    all_procs = [int(p) for p in opts.procs.split(",")]
    spreads: list[int | None] = [None]
    if opts.pools is not None:
        ks = [int(k) for k in opts.pools.split(",")]
        if min(ks) < 1:
            parser.error("--pools: at least one pool")
        if max(ks) > 1 and max(depths) > 0:
            parser.error("--depths fills one pool's line: use it with --pools 1")
        if any(opts.cycles // n * n < max(ks) for n in all_procs):
            parser.error("--cycles: fewer cycles than pools, some pools would get none")
        spreads = list(ks)
    import django

    django.setup()
    strategy = opts.strategy or "priority"
    report: dict[str, Any] = {
        "cycles": opts.cycles,
        "reps": opts.reps,
        "strategy": strategy,
        "rate": rate,
        "by_procs": {},
    }
    if opts.pools is not None:
        report["pools"] = spreads
    try:
        for depth in depths:
            for procs in all_procs:
                for pools in spreads:
                    label = f"{procs}" if pools is None else f"{procs}x{pools}"
                    label += "" if depth == 0 else f"@{depth}"
                    report["by_procs"][label] = _repeat(opts, procs, depth, rate, pools)
                    print(json.dumps({label: report["by_procs"][label]}), flush=True)
    finally:
        w7_tables.reset(ballast=False)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
