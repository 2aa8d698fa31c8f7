"""W1 throughput, W2 hand-off latency, W3 queue depth, W4 many pools.

Each function runs ``options.reps`` repetitions and stores, in ``ctx.results[<workload>]``,
the raw figure of every repetition and its median/min/max.
"""

from __future__ import annotations

import json
from typing import Any

from django.db import connection

from pools.bench import backlog, bulk_copy, database, stats, tasks
from pools.bench.context import Context
from pools.bench.runs import plain_run, pooled_run
from pools.bench.workers import FLOOR_QUEUE, PLAIN_QUEUE
from pools.models import QueueEntry

#: The 20 ms body of W1 (and W5).
SLOW = 0.02


def _body(sleep: float) -> str:
    return "no-op" if sleep == 0 else f"{sleep * 1000:.0f} ms"


#: What W1 records per repetition.
W1_FIGURES = (
    "pooled",
    "plain",
    "ratio",
    "submit_pooled",
    "submit_plain",
    "peak",
    "completed",
    "lag_pooled",
    "lag_plain",
    "wal_bytes",
)


def w1_throughput(ctx: Context) -> dict[str, Any]:
    """Pooled vs plain tasks/s with a backlog, no-op and 20 ms bodies; the ratio."""
    o = ctx.options
    out: dict[str, Any] = {"slots": o.total_concurrency}
    for sleep, count in ((0.0, o.tasks), (SLOW, o.slow_tasks)):
        body = _body(sleep)
        reps: dict[str, list[float]] = {k: [] for k in W1_FIGURES}
        cpu_reps: dict[str, list[dict[str, float]]] = {"plain": [], "pooled": []}
        stage_runs: list[dict[str, list[float]]] = []
        for rep in range(o.reps):
            tag = f"{rep + 1}/{o.reps}"
            plain = plain_run(
                ctx,
                f"W1 plain {body} {tag}",
                tasks.plain,
                count,
                lambda j, s=sleep: [j, s],  # type: ignore[misc]
                queue=PLAIN_QUEUE,
                workers=ctx.main,
            )
            pooled = pooled_run(
                ctx,
                f"W1 pooled {body} {tag}",
                [(tasks.POOLED[tasks.W1_POOL], range(count))],
                [tasks.W1_POOL],
                sleep=sleep,
                real=o.submit_sample,
            )
            reps["pooled"].append(pooled.throughput)
            reps["plain"].append(plain.throughput)
            reps["ratio"].append(pooled.throughput / plain.throughput)
            reps["submit_pooled"].append(pooled.submit_rate)
            reps["submit_plain"].append(plain.submit_rate)
            reps["lag_pooled"].append(pooled.start_lag)
            reps["lag_plain"].append(plain.start_lag)
            reps["peak"].append(stats.max_concurrency(pooled.spans))
            reps["completed"].append(len(pooled.spans))
            if pooled.wal_bytes is not None:
                reps["wal_bytes"].append(pooled.wal_bytes)
            if pooled.stages:
                stage_runs.append(pooled.stages)
            for kind, run in (("plain", plain), ("pooled", pooled)):
                if run.cpu_ms is not None:
                    cpu_reps[kind].append(run.cpu_ms)
        out[body] = {
            "tasks": count,
            "reps": reps,
            **{k: stats.summary(v) for k, v in reps.items() if k != "completed"},
            "cpu_ms_per_task": {kind: stats.median_by_key(runs) for kind, runs in cpu_reps.items()},
            "stages": stats.stage_summary(stage_runs),
        }
    return out


def w2_handoff(ctx: Context) -> dict[str, Any]:
    """A 1-slot pool with a line of short tasks; plain Celery's own pickup floor beside it."""
    o = ctx.options
    n = o.handoff_tasks
    pool = tasks.W2_POOL
    runs: dict[str, list[dict[str, float]]] = {"settle_to_start": [], "end_to_start": []}
    runs["floor_end_to_start"] = []
    samples: dict[str, list[float]] = {k: [] for k in runs}
    gaps_counted: list[int] = []
    stage_runs: list[dict[str, list[float]]] = []
    peak = 0
    assert ctx.floor is not None
    for rep in range(o.reps):
        tag = f"{rep + 1}/{o.reps}"
        floor = plain_run(
            ctx,
            f"W2 plain floor (1x1) {tag}",
            tasks.plain,
            n,
            lambda j: [j, 0.0],
            queue=FLOOR_QUEUE,
            workers=[ctx.floor],
        )
        pooled = pooled_run(
            ctx, f"W2 pooled 1 slot {tag}", [(tasks.POOLED[pool], range(n))], [pool]
        )
        settled = dict(  # the settle's time, which the entry carries
            QueueEntry.objects.filter(
                key__in=list(pooled.keys.values()), finished_at__isnull=False
            ).values_list("key", "finished_at")
        )
        marks = {i: t.timestamp() for i, key in pooled.keys.items() if (t := settled.get(key))}
        gaps = {
            "settle_to_start": stats.gaps_after(pooled.spans, marks),
            "end_to_start": stats.serial_gaps(pooled.spans),
            "floor_end_to_start": stats.serial_gaps(floor.spans),
        }
        for k, values in gaps.items():
            runs[k].append(stats.distribution(values))
        samples_last = gaps
        gaps_counted.append(len(gaps["settle_to_start"]))
        if pooled.stages:
            stage_runs.append(pooled.stages)
        peak = max(peak, stats.max_concurrency(pooled.spans))
    for k in samples:
        samples[k] = samples_last[k]
    return {
        "tasks": n,
        "gaps_per_rep": gaps_counted,
        "peak": peak,
        "stages": stats.stage_summary(stage_runs),
        "reps": runs,
        **{
            k: {q: stats.summary([r[q] for r in v]) for q in ("p50", "p95", "p99")}
            for k, v in runs.items()
        },
        # The last repetition's gaps, for the plot.
        "samples": samples,
    }


def _relation_bytes() -> dict[str, int] | None:
    """Bytes of the entry, demand and event tables with their indexes (PostgreSQL only)."""
    if connection.vendor != "postgresql":
        return None
    tables = ["pools_queueentry", "pools_demand", "pools_poolevent"]
    with connection.cursor() as cursor:
        cursor.execute("SELECT " + ", ".join("pg_total_relation_size(%s)" for _ in tables), tables)
        row = cursor.fetchone()
    return dict(zip(tables, (int(v) for v in row), strict=True)) if row else None


def _bytes_per_live_row() -> dict[str, float]:
    """Table + index bytes per live row of each queue table (after ``ANALYZE``)."""
    sizes = _relation_bytes() or {}
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT relname, n_live_tup FROM pg_stat_user_tables WHERE relname = ANY(%s)",
            [list(sizes)],
        )
        rows = dict(cursor.fetchall())
    return {t: sizes[t] / rows[t] for t in sizes if rows.get(t)}


def _waiting_filler(pool: str) -> int:
    from pools.models import Demand

    return int(Demand.objects.waiting().filter(pool__name=pool, priority=FILLER_PRIORITY).count())


#: W3 filler entries wait behind the timed ones (lower priority), so the depth stays put.
FILLER_PRIORITY = -1
FILLER_ARGS = [-1, 0.0]


def w3_depth(ctx: Context) -> dict[str, Any]:
    """The W1 loop through a pool whose line already holds 1k / 10k / 100k waiting entries."""
    o = ctx.options
    pool = tasks.W3_POOL
    task = tasks.POOLED[pool]
    template, _ = backlog.backlog(
        task,
        1,
        lambda j: FILLER_ARGS,
        queue="pools-bench",
        real=1,
        priority_for=lambda j: FILLER_PRIORITY,
    )
    ctx.track(template)
    out: dict[str, Any] = {"tasks": o.depth_tasks, "depths": {}}
    memory: dict[str, Any] | None = None
    for depth in sorted(o.depths):
        have = _waiting_filler(pool)
        before = _relation_bytes()
        if depth > have:
            ctx.track(
                bulk_copy.copy_entries(
                    template[0],
                    range(depth - have),
                    lambda j: FILLER_ARGS,
                    lambda j: FILLER_PRIORITY,
                    label=f"W3 filling the line to {depth:,}",
                )
            )
        after = _relation_bytes()
        if depth > have:
            database.settle_tables()
        if before and after and depth - have >= 10000:
            added = depth - have
            growth = (sum(after.values()) - sum(before.values())) / added
            # Growth under-reports where the load reused free space of deleted rows (an
            # earlier run); the average over all rows after VACUUM (indexes and free space
            # included) over-reports. The larger of the two is reported.
            average = _bytes_per_live_row()
            memory = {
                "rows_added": added,
                "args_bytes": len(json.dumps(FILLER_ARGS)),
                "bytes_per_entry": {k: (after[k] - before[k]) / added for k in after},
                "growth_per_entry": growth,
                "average_per_row": average,
                "total_per_entry": max(growth, sum(average.values())),
            }
        per_rep: list[float] = []
        seen_depths: list[int] = []
        for rep in range(o.reps):
            seen_depths.append(_waiting_filler(pool))
            run = pooled_run(
                ctx,
                f"W3 depth {depth:,} {rep + 1}/{o.reps}",
                [(task, range(o.depth_tasks))],
                [pool],
            )
            per_rep.append(run.throughput)
        out["depths"][str(depth)] = {
            "waiting": seen_depths,
            "reps": per_rep,
            **stats.summary(per_rep),
        }
    lo, hi = min(o.depths), max(o.depths)
    if lo != hi:
        out["ratio"] = out["depths"][str(hi)]["median"] / out["depths"][str(lo)]["median"]
        out["ratio_of"] = f"{hi}/{lo}"
    out["memory"] = memory
    return out


def w4_many_pools(ctx: Context) -> dict[str, Any]:
    """Tasks spread evenly over 100 one-slot pools; and a mix of one- and two-pool tasks."""
    o = ctx.options
    n = o.many_tasks
    out: dict[str, Any] = {"tasks": n, "pools": len(tasks.MANY_POOLS)}
    many_groups = [
        (tasks.POOLED[name], range(p, n, len(tasks.MANY_POOLS)))
        for p, name in enumerate(tasks.MANY_POOLS)
    ]
    multi_groups = [
        (tasks.POOLED[tasks.MULTI_A], range(0, n, 3)),
        (tasks.POOLED[tasks.MULTI_B], range(1, n, 3)),
        (tasks.POOLED[tasks.MULTI_AB], range(2, n, 3)),
    ]
    for label, groups, pools in (
        ("many", many_groups, tasks.MANY_POOLS),
        ("multi", multi_groups, [tasks.MULTI_A, tasks.MULTI_B]),
    ):
        per_rep: list[float] = []
        peaks: list[int] = []
        for rep in range(o.reps):
            run = pooled_run(
                ctx,
                f"W4 {label} pools {rep + 1}/{o.reps}",
                [(t, idx) for t, idx in groups if len(idx)],
                pools,
                real=1,
            )
            per_rep.append(run.throughput)
            peaks.append(stats.max_concurrency(run.spans))
        out[label] = {"reps": per_rep, "peak": peaks, **stats.summary(per_rep)}
    return out
