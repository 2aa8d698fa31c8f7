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

``--rate`` gives the pool a rate (``"N/s|m|h|d"``, or several separated by commas): with
one no run reaches (``100000/s``) every admission checks and records it but none is
refused, so the figures beside a run without ``--rate`` are what the rate check costs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
import uuid
from collections.abc import Sequence
from typing import Any

#: Name of the pool this script creates (and deletes).
POOL = "bench-core"

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
#: The place of the waiting filler entries (``--depths``): behind every timed entry.
FILLER_ROUND = 2**60


def _worker(cycles: int, own: bool, barrier: Any, out: Any) -> None:
    """One process: ``cycles`` enqueues, and start + settle of whatever it admitted."""
    import django

    django.setup()
    from django.test.utils import override_settings

    from pools.bench import core  # this module under its own name (not ``__main__``)
    from pools.core import admission, leases
    from pools.core.records import Submission
    from pools.pg import fastpath
    from pools.specs import PoolSpec

    if own:
        fastpath.use_own_connection()
    spec = PoolSpec.build(POOL, 1)
    lock_calls: list[float] = []
    backend = fastpath.own_backend_pid() if own else _backend_pid()
    backend_ticks = _ticks(backend)
    own_ticks = _ticks(os.getpid())
    worker = f"w7-{os.getpid()}"
    with override_settings(POOLS={"PUBLISHER": "pools.bench.core.bridge"}):
        barrier.wait()
        for i in range(cycles):
            t0 = time.perf_counter()
            admission.enqueue(
                Submission(
                    key=str(uuid.uuid4()),
                    task_name="w7.noop",
                    spec=spec,
                    args=[],
                    fairness_key=f"t{(os.getpid() + i) % KEYS}",
                )
            )
            lock_calls.append(time.perf_counter() - t0)
            while core._admitted:
                adm = core._admitted.pop(0)
                claim = leases.start(adm.entry_id, adm.token, worker=worker)
                if claim is None:
                    raise RuntimeError(f"W7: start of entry {adm.entry_id} refused")
                t0 = time.perf_counter()
                # As a worker settles: with when and where it started (a fenced start
                # wrote neither).
                if not admission.settle(
                    adm.entry_id,
                    adm.token,
                    "succeeded",
                    live_lease=True,
                    started_at=claim.started_at,
                    worker=claim.worker,
                ):
                    raise RuntimeError(f"W7: settle of entry {adm.entry_id} refused")
                lock_calls.append(time.perf_counter() - t0)
    out.put(
        {
            "lock_calls": lock_calls,
            "client_ticks": _ticks(os.getpid()) - own_ticks,
            "backend_ticks": _ticks(backend) - backend_ticks,
        }
    )


#: Finished entries kept in the tables during the runs (another pool's), as retention
#: keeps them in production: planned against empty tables, the functions' cached plans
#: scan them sequentially, and a run would measure that instead (the figures before
#: 2026-12-05 did: 64-228 admissions/s).
BALLAST = 20_000
BALLAST_POOL = "bench-core-ballast"


def _ballast() -> None:
    """:data:`BALLAST` finished entries of :data:`BALLAST_POOL` (made once, kept)."""
    from django.db import connection

    from pools.bench import bulk_copy
    from pools.core import admission
    from pools.core.records import Submission
    from pools.models import Pool, QueueEntry
    from pools.specs import PoolSpec
    from pools.states import EntryState

    have = QueueEntry.objects.filter(demand__has_key=BALLAST_POOL).count()
    if have >= BALLAST:
        return
    pool, _ = Pool.objects.get_or_create(name=BALLAST_POOL, defaults={"slots": 1, "paused": True})
    first = Submission(key=str(uuid.uuid4()), task_name="w7.done", spec=PoolSpec.build(pool.name))
    admission.enqueue(first)
    bulk_copy.copy_entries(first.key, range(BALLAST - have - 1), lambda j: [])
    done = EntryState.SUCCEEDED.value
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE pools_queueentry SET state = %s, admitted_at = enqueued_at, "
            "started_at = enqueued_at, finished_at = enqueued_at WHERE queue_id IN "
            "(SELECT entry_id FROM pools_demand WHERE pool_id = %s AND state = 'waiting')",
            [done, pool.pk],
        )
        cursor.execute("UPDATE pools_demand SET state = %s WHERE pool_id = %s", [done, pool.pk])


def _reset(*, ballast: bool = True) -> None:
    from django.db import connection

    from pools.models import Pool, PoolEvent, QueueEntry

    QueueEntry.objects.filter(demand__has_key=POOL).delete()
    PoolEvent.objects.filter(pool=POOL).delete()
    Pool.objects.filter(name=POOL).delete()
    if ballast:
        _ballast()
    else:
        QueueEntry.objects.filter(demand__has_key=BALLAST_POOL).delete()
        Pool.objects.filter(name=BALLAST_POOL).delete()
    with connection.cursor() as cursor:
        for table in ("pools_queueentry", "pools_demand", "pools_poolevent", "pools_pool"):
            cursor.execute(f"VACUUM ANALYZE {table}")
        cursor.execute("CHECKPOINT")


def _fill(depth: int, procs: int) -> None:
    """``depth`` entries waiting in the (paused) pool's line, behind every timed entry.

    Each asks for one slot more than the pool will have (``procs``), so one that heads the
    line (no timed entry waits) is never admitted: it waits for its slots, as any head
    does, on the fast path, and a timed entry placed before it goes first.
    """
    from django.db import connection

    from pools.bench import bulk_copy
    from pools.core import admission
    from pools.core.records import Submission
    from pools.models import Pool
    from pools.specs import PoolSpec
    from pools.states import EntryState

    spec = PoolSpec.build(POOL, procs + 1)
    first = Submission(key=str(uuid.uuid4()), task_name="w7.filler", spec=spec)
    admission.enqueue(first)
    bulk_copy.copy_entries(first.key, range(depth - 1), lambda j: [])
    pool = Pool.objects.get(name=POOL)
    key = "'bulk-' || (entry_id %% 100)" if pool.strategy == "fair" else "NULL"
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE pools_demand SET line_round = %s, fairness_key = {key} "
            "WHERE pool_id = %s AND state = %s",
            [FILLER_ROUND, pool.pk, EntryState.WAITING.value],
        )
        cursor.execute("VACUUM ANALYZE pools_demand")
        cursor.execute("VACUUM ANALYZE pools_queueentry")


def run_once(
    procs: int,
    cycles: int,
    own: bool = True,
    *,
    strategy: str = "priority",
    depth: int = 0,
    rate: list[str] | None = None,
) -> dict[str, Any]:
    """One repetition with ``procs`` processes and ``cycles`` tasks in all."""
    from django.db import connections

    from pools.models import Pool, QueueEntry
    from pools.states import EntryState

    _reset()
    Pool.objects.create(name=POOL, slots=procs + 1, strategy=strategy, paused=True)
    if rate:
        from pools.bench import rates

        rates.set_rate(POOL, rate if len(rate) > 1 else rate[0])
    if depth:
        _fill(depth, procs)
    Pool.objects.filter(name=POOL).update(slots=procs, paused=False)
    connections.close_all()  # the children open their own
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(procs + 1)
    out = ctx.Queue()
    each = max(cycles // procs, 1)
    children = [ctx.Process(target=_worker, args=(each, own, barrier, out)) for _ in range(procs)]
    for child in children:
        child.start()
    from pools.bench import database

    wal0 = database.wal_position()
    connections.close_all()
    barrier.wait()
    t0 = time.perf_counter()
    results = [out.get(timeout=600) for _ in children]
    elapsed = time.perf_counter() - t0
    for child in children:
        child.join()
    wal = database.wal_bytes_since(wal0)
    total = each * procs
    done = QueueEntry.objects.filter(demand__has_key=POOL, state=EntryState.SUCCEEDED).count()
    if done != total:
        raise RuntimeError(f"W7: {done} of {total} entries succeeded")
    waiting = QueueEntry.objects.filter(demand__has_key=POOL, state=EntryState.WAITING).count()
    if waiting != depth:
        raise RuntimeError(f"W7: {waiting} entries wait at the end, not the {depth} filled in")
    calls = sorted(c for r in results for c in r["lock_calls"])
    hz = os.sysconf("SC_CLK_TCK")
    return {
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
    opts = parser.parse_args(argv)
    rate = [r.strip() for r in opts.rate.split(",") if r.strip()] if opts.rate else None
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
    try:
        for depth in [int(d) for d in opts.depths.split(",")]:
            for procs in [int(p) for p in opts.procs.split(",")]:
                runs = [
                    run_once(
                        procs,
                        opts.cycles,
                        opts.connection == "own",
                        strategy=strategy,
                        depth=depth,
                        rate=rate,
                    )
                    for _ in range(opts.reps)
                ]
                rates = [r["admissions_per_s"] for r in runs]
                mid = sorted(runs, key=lambda r: r["admissions_per_s"])[len(runs) // 2]
                label = f"{procs}" if depth == 0 else f"{procs}@{depth}"
                report["by_procs"][label] = {
                    **mid,
                    "admissions_per_s_min": min(rates),
                    "admissions_per_s_max": max(rates),
                    "admissions_per_s_median": statistics.median(rates),
                }
                print(json.dumps({label: report["by_procs"][label]}), flush=True)
    finally:
        _reset(ballast=False)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
