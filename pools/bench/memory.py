"""Memory: worker RSS with and without pools (bytes per waiting entry come from W3).

Two fresh workers of the same size run the same no-op body: one only plain Celery tasks, the
other only pooled ones (gate, claim, lease keeper thread, database connection). Both import
the project, so pools' import cost is in both; the difference is what running pooled tasks
adds to a warm pool process.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from pools.bench import backlog, tasks
from pools.bench.context import Context
from pools.bench.runs import pooled_run
from pools.bench.workers import MEM_PLAIN_QUEUE, MEM_POOLED_QUEUE, Worker


def _rss(worker: Worker) -> dict[str, Any]:
    rss = worker.rss()
    children = [b for b in rss["children"] if b]
    return {
        "master": rss["master"],
        "children": children,
        "child_mean": statistics.mean(children) if children else 0.0,
    }


def memory(ctx: Context) -> dict[str, Any]:
    """RSS of the pool processes after ``memory_tasks`` plain vs pooled no-op tasks."""
    o = ctx.options
    assert ctx.mem_plain is not None and ctx.mem_pooled is not None
    n = o.memory_tasks
    ids, _ = backlog.submit(tasks.plain, n, lambda j: [j, 0.0], queue=MEM_PLAIN_QUEUE)
    ctx.track(ids)
    backlog.collect(
        ctx.app, ids, "memory: plain worker", timeout=o.timeout, check=ctx.fleet.check_alive
    )
    backlog.create_pools({tasks.MEM_POOL: ctx.mem_pooled.concurrency})
    pooled_run(
        ctx,
        "memory: pooled worker",
        [(tasks.POOLED[tasks.MEM_POOL], range(n))],
        [tasks.MEM_POOL],
        queue=MEM_POOLED_QUEUE,
    )
    time.sleep(1.0)  # let the last settles finish before reading RSS
    plain, pooled = _rss(ctx.mem_plain), _rss(ctx.mem_pooled)
    return {
        "tasks": n,
        "plain": plain,
        "pooled": pooled,
        "child_overhead": pooled["child_mean"] - plain["child_mean"],
        "master_overhead": pooled["master"] - plain["master"],
    }
