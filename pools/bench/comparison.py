"""W5: pools against the common recipe (:mod:`pools.bench.recipe`) on the same work.

Both limit the same backlog to the same number of slots (half the workers' processes by
default, so that the limit, not the process count, is what binds) with mixed priorities
(0, 5, 10; Celery message priority for the recipe, pool priority for pools), no-op and
20 ms bodies. Then the kill test: a holder is SIGKILLed while it holds the only slot, and
the clock runs until a body starts on that slot again.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Any

from django.db import connection
from django.db.models import Sum

from pools import conf
from pools.bench import backlog, errors, recipe, stats, tasks
from pools.bench.context import Context
from pools.bench.runs import Run, plain_run, pooled_run
from pools.bench.workers import POOLED_QUEUE, RECIPE_QUEUE
from pools.bench.workloads import SLOW
from pools.core import sweeps
from pools.models import QueueEntry

#: Pool priorities of the mix, and the Celery (Redis) message priority the recipe uses for
#: each: on Redis, 0 is served first.
LEVELS = (0, 5, 10)
CELERY_PRIORITY = {0: 9, 5: 3, 10: 0}
#: How long a kill-test holder would hold its slot if it were not killed (seconds).
HOLD = 600.0


def _figures(run: Run, limit: int, order: dict[str, Any]) -> dict[str, Any]:
    gaps = stats.handoff_gaps(run.spans)
    return {
        "throughput": run.throughput,
        "handoff": stats.distribution(gaps),
        "retries": sum(int(s.get("r", 0)) for s in run.spans),
        "inversions": stats.inversions(order["items"]),
        "order": order["source"],
        "peak": stats.max_concurrency(run.spans),
        "limit": limit,
    }


def recipe_order(spans: list[dict[str, Any]], prio: dict[int, int], mark: int) -> dict[str, Any]:
    """``(priority, queued, acquired)`` of each recipe task, on the semaphore's counter.

    Every task was submitted before ``mark`` (the counter was bumped once the backlog was
    published, before any worker consumed it) and acquired at its own number, given by the
    atomic acquire script (:mod:`pools.bench.recipe`).
    """
    if all("n" in s for s in spans):
        items = [(prio[int(s["i"])], float(mark), float(s["n"])) for s in spans]
        return {"items": items, "source": "semaphore acquisition counter"}
    # Bodies of an older recipe task: the acquire timestamps (several processes' clocks).
    items = [(prio[int(s["i"])], float("-inf"), float(s["a"])) for s in spans]
    return {"items": items, "source": "acquire timestamps"}


def pools_order(pool: str, keys: list[str]) -> dict[str, Any]:
    """``(priority, queued, acquired)`` of each pooled task, in the order of admission.

    Admissions of one pool are serialized by its row lock, which counts them: each entry's
    ``admission_seq`` is its place in that count, the order in which entries took their
    slots, free of the clock and pickup jitter of the bodies' start times. The priority is
    the entry's own. Every entry counts as queued before the first admission (the backlog
    is in line before the pool is released).
    """
    rows = list(
        QueueEntry.objects.filter(key__in=keys, admission_seq__isnull=False)
        .order_by("admission_seq")
        .values_list("priority", flat=True)
    )
    # Every entry was in line before the pool was released.
    items = [(prio, -1.0, float(rank)) for rank, prio in enumerate(rows)]
    return {"items": items, "source": "admission order (admission_seq)"}


def w5_recipe(ctx: Context, redis_url: str) -> dict[str, Any]:
    """Throughput, hand-off, wasted retries, inversions and oversubscription; then the kill test."""
    o = ctx.options
    limit = o.recipe_limit or max(1, o.total_concurrency // 2)
    n = o.recipe_tasks
    backlog.create_pools({tasks.W5_POOL: limit})
    out: dict[str, Any] = {"tasks": n, "limit": limit, "ttl": o.recipe_ttl}
    for sleep in (0.0, SLOW):
        body = "no-op" if sleep == 0 else f"{sleep * 1000:.0f} ms"
        per: dict[str, list[dict[str, Any]]] = {"pools": [], "recipe": []}
        for rep in range(o.reps):
            tag = f"{rep + 1}/{o.reps}"
            rng = random.Random(o.seed * 1000 + rep)
            prio = {j: rng.choice(LEVELS) for j in range(n)}
            key = f"pools-bench:{ctx.run_id}:w5:{rep}:{body}"
            semaphore = recipe.Semaphore(redis_url, key, limit, o.recipe_ttl)
            ctx.semaphores.extend([key, semaphore.sequence_key])
            marks: list[int] = []
            run = plain_run(
                ctx,
                f"W5 recipe {body} {tag}",
                recipe.limited,
                n,
                lambda j, s=sleep, k=key: [j, s, redis_url, k, limit, o.recipe_ttl],  # type: ignore[misc]
                queue=RECIPE_QUEUE,
                workers=ctx.main,
                options_for=lambda j, p=prio: {"priority": CELERY_PRIORITY[p[j]]},  # type: ignore[misc]
                before_release=lambda m=marks, sem=semaphore: m.append(sem.mark()),  # type: ignore[misc]
            )
            per["recipe"].append(_figures(run, limit, recipe_order(run.spans, prio, marks[0])))
            run = pooled_run(
                ctx,
                f"W5 pools {body} {tag}",
                [(tasks.POOLED[tasks.W5_POOL], range(n))],
                [tasks.W5_POOL],
                sleep=sleep,
                priority_for=prio.__getitem__,
            )
            figures = _figures(run, limit, pools_order(tasks.W5_POOL, list(run.keys.values())))
            # Each admission is delivered once (its token counts the admissions).
            figures["deliveries"] = (
                QueueEntry.objects.filter(
                    key__in=list(run.keys.values()), started_at__isnull=False
                ).aggregate(n=Sum("token"))["n"]
                or 0
            )
            per["pools"].append(figures)
        out[body] = {
            side: {
                "reps": reps,
                "throughput": stats.summary([r["throughput"] for r in reps]),
                **{
                    f"handoff_{q}": stats.summary([r["handoff"][q] for r in reps])
                    for q in ("p50", "p95", "p99")
                },
                "retries": stats.summary([r["retries"] for r in reps]),
                "inversions": stats.summary([r["inversions"] for r in reps]),
                "inversions_from": sorted({r["order"] for r in reps}),
                "peak": max(r["peak"] for r in reps),
            }
            for side, reps in per.items()
        }
    out["kill"] = kill_test(ctx, redis_url)
    return out


def _wait_holding(ctx: Context, task_id: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        result = ctx.app.AsyncResult(task_id)
        if result.state == "HOLDING" and isinstance(result.info, dict):
            return result.info
        if time.monotonic() > deadline:
            raise errors.BenchError(f"kill test: holder {task_id} is {result.state}, not holding")
        time.sleep(0.05)


class _Sweeper(threading.Thread):
    """Runs the sweep every ``SWEEP_SECONDS``, as celery-beat does, during the kill test."""

    def __init__(self) -> None:
        super().__init__(name="bench-sweeper", daemon=True)
        self.stopped = threading.Event()
        self.passes = 0

    def run(self) -> None:
        try:
            while not self.stopped.wait(conf.get().SWEEP_SECONDS):
                sweeps.sweep()
                self.passes += 1
        finally:
            connection.close()


def _final_state(ctx: Context, task_id: str, timeout: float = 10.0) -> str:
    """The task's state once final: the worker stores a killed child's WorkerLostError
    failure a moment after the next task may already have started."""
    result = ctx.app.AsyncResult(task_id)
    deadline = time.monotonic() + timeout
    while not result.ready() and time.monotonic() < deadline:
        time.sleep(0.1)
    return str(result.state)


def kill_test(ctx: Context, redis_url: str) -> dict[str, Any]:
    """SIGKILL a holder of a 1-slot pool / semaphore; seconds until a body starts there again.

    ``reps`` holders of each kind are killed at the same moment (separate pools/semaphores).
    Pools get their slot back when the lease lapses and a sweep re-queues the entry (the
    killed task then runs again: at-least-once); the recipe when its TTL drops the holder
    (the killed task is lost: Celery acks it as failed with ``WorkerLostError``).
    """
    o = ctx.options
    reps = min(o.reps, len(tasks.KILL_POOLS))
    pools = tasks.KILL_POOLS[:reps]
    backlog.create_pools(dict.fromkeys(pools, 1))
    backlog.release(pools)
    keys = [f"pools-bench:{ctx.run_id}:kill:{k}" for k in range(reps)]
    ctx.semaphores.extend(keys + [recipe.sequence_key(k) for k in keys])
    ctx.fleet.consume(RECIPE_QUEUE, ctx.main)
    sweeper = _Sweeper()
    try:
        pooled_holders = ctx.track(
            [tasks.POOLED[p].apply_async((0, 0.0, HOLD), queue=POOLED_QUEUE).id for p in pools]
        )
        recipe_holders = ctx.track(
            [
                recipe.limited.apply_async(
                    (0, 0.0, redis_url, k, 1, o.recipe_ttl, HOLD), queue=RECIPE_QUEUE
                ).id
                for k in keys
            ]
        )
        holding = [_wait_holding(ctx, t, 60) for t in pooled_holders + recipe_holders]
        pooled_next = ctx.track(
            [tasks.POOLED[p].apply_async((1, 0.0), queue=POOLED_QUEUE).id for p in pools]
        )
        recipe_next = ctx.track(
            [
                recipe.limited.apply_async(
                    (1, 0.0, redis_url, k, 1, o.recipe_ttl), queue=RECIPE_QUEUE
                ).id
                for k in keys
            ]
        )
        time.sleep(0.5)  # both kinds of waiter are in line / retrying
        killed_at = time.time()
        for info in holding:
            os.kill(int(info["pid"]), signal.SIGKILL)
        sweeper.start()
        spans = backlog.collect(
            ctx.app,
            pooled_next + recipe_next,
            "W5 kill test (pools + recipe)",
            timeout=max(o.recipe_ttl, conf.get().LEASE_SECONDS) + 120,
            check=ctx.fleet.check_alive,
        )
    finally:
        sweeper.stopped.set()
        ctx.fleet.stop_consuming(RECIPE_QUEUE, ctx.main)
    by_id = dict(
        zip(pooled_next + recipe_next, _ordered(ctx, pooled_next + recipe_next, spans), strict=True)
    )
    pooled_back = []
    for holder, nxt in zip(pooled_holders, pooled_next, strict=True):
        restarted = (  # the entry carries its last start: that of the new attempt
            QueueEntry.objects.filter(key=holder, token__gt=1)
            .values_list("started_at", flat=True)
            .first()
        )
        first = min([by_id[nxt]["s"], *([restarted.timestamp()] if restarted else [])])
        pooled_back.append(first - killed_at)
    recipe_back = [by_id[nxt]["s"] - killed_at for nxt in recipe_next]
    recipe_lost = sum(_final_state(ctx, t) == "FAILURE" for t in recipe_holders)
    pooled_rerun = sum(_final_state(ctx, t) == "SUCCESS" for t in pooled_holders)
    recipe_retries = sum(int(by_id[t].get("r", 0)) for t in recipe_next)
    backlog.pause(pools)
    return {
        "holders": reps,
        "lease_seconds": conf.get().LEASE_SECONDS,
        "recipe_ttl": o.recipe_ttl,
        "sweep_seconds": conf.get().SWEEP_SECONDS,
        "sweeps": sweeper.passes,
        "pools": {"reps": pooled_back, **stats.summary(pooled_back)},
        "recipe": {"reps": recipe_back, **stats.summary(recipe_back)},
        "pools_killed_task_ran_again": pooled_rerun,
        "recipe_killed_task_lost": recipe_lost,
        "recipe_retries_while_stranded": recipe_retries,
    }


def _ordered(ctx: Context, ids: list[str], spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The spans in the order of ``ids`` (each result is read by id)."""
    return [ctx.app.AsyncResult(t).result for t in ids]
