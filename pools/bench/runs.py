"""One timed run: a backlog released at once and drained, pooled or plain."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from celery import Task

from pools.bench import backlog, cpu, database, stats
from pools.bench.context import Context
from pools.bench.workers import POOLED_QUEUE, Worker

#: Pooled calls per backlog sent through ``apply_async`` (the real gate) outside W1; the rest
#: are bulk copies of the first (:func:`pools.bench.backlog.backlog`). W1, which reports the
#: submit rate, sends ``--submit-sample`` calls.
REAL_CALLS = 10


@dataclass(frozen=True, kw_only=True)
class Run:
    """What one run saw."""

    #: Task id of each index.
    keys: dict[int, str]
    #: The bodies' reports (one per index).
    spans: list[dict[str, Any]]
    #: ``time.time()`` when the backlog was released.
    released_at: float
    #: Submit rate of the real ``apply_async`` calls (calls/s).
    submit_rate: float
    #: CPU milliseconds per task by process group from the release to the last body
    #: (:mod:`pools.bench.cpu`; None where it cannot be read).
    cpu_ms: dict[str, float] | None = None
    #: PostgreSQL write-ahead log written per task over the same window (None elsewhere).
    wal_bytes: float | None = None
    #: Pooled runs: seconds each task spent in each stage of :data:`pools.bench.stats.STAGES`.
    stages: dict[str, list[float]] | None = None

    @property
    def throughput(self) -> float:
        """Tasks per second from the first body's start to the last body's end."""
        return stats.throughput(self.spans)

    @property
    def start_lag(self) -> float:
        """Seconds from the release to the first body's start (outside the clock)."""
        return stats.start_lag(self.spans, self.released_at)


def pooled_run(
    ctx: Context,
    label: str,
    groups: Sequence[tuple[Task, Sequence[int]]],
    pools: Sequence[str],
    *,
    sleep: float = 0.0,
    priority_for: Callable[[int], int] | None = None,
    real: int | None = None,
    queue: str = POOLED_QUEUE,
) -> Run:
    """Queue each group's indexes in its (paused) pool, release ``pools``, wait for every body.

    ``real`` calls of each group go through ``apply_async`` (default :data:`REAL_CALLS`), the
    rest are bulk copies. The pools are paused again afterwards and the run returns once
    nothing holds a slot.
    """
    database.settle_tables(checkpoint=False)
    keys: dict[int, str] = {}
    rates = []
    sample = REAL_CALLS if real is None else real
    for task, indexes in groups:
        ids, rate = backlog.backlog(
            task,
            len(indexes),
            lambda k, idx=indexes: [idx[k], sleep],  # type: ignore[misc]
            queue=queue,
            real=sample,
            priority_for=(lambda k, idx=indexes: priority_for(idx[k])) if priority_for else None,  # type: ignore[misc]
        )
        ctx.track(ids)
        keys.update(zip(indexes, ids, strict=True))
        rates.append(rate)
    cpu_before = cpu.snapshot(ctx.fleet.main_pids())
    wal_before = database.wal_position()
    released_at = backlog.release(pools)
    try:
        spans = backlog.collect(
            ctx.app,
            list(keys.values()),
            label,
            timeout=ctx.options.timeout,
            check=ctx.fleet.check_alive,
        )
        cpu_ms = cpu.per_task_ms(cpu_before, cpu.snapshot(ctx.fleet.main_pids()), len(spans))
        wal = database.wal_bytes_since(wal_before)
    finally:
        backlog.pause(pools)
    backlog.wait_idle(pools)
    stats.check_complete(spans, keys)
    times = backlog.entry_times(keys)
    return Run(
        keys=keys,
        spans=spans,
        released_at=released_at,
        submit_rate=min(rates, default=0.0),
        cpu_ms=cpu_ms,
        wal_bytes=None if wal is None else wal / max(len(spans), 1),
        stages=stats.stages(spans, times),
    )


def plain_run(
    ctx: Context,
    label: str,
    task: Task,
    count: int,
    args_for: Callable[[int], list[Any]],
    *,
    queue: str,
    workers: list[Worker],
    options_for: Callable[[int], dict[str, Any]] | None = None,
    before_release: Callable[[], None] | None = None,
) -> Run:
    """Publish ``count`` calls to a held queue, let ``workers`` consume it, wait for every body.

    ``before_release`` is called once everything is published, just before the release.
    """
    ids, rate = backlog.submit(task, count, args_for, queue=queue, options_for=options_for)
    ctx.track(ids)
    if before_release is not None:
        before_release()
    cpu_before = cpu.snapshot(ctx.fleet.main_pids())
    released_at = time.time()
    ctx.fleet.consume(queue, workers)
    try:
        spans = backlog.collect(
            ctx.app, ids, label, timeout=ctx.options.timeout, check=ctx.fleet.check_alive
        )
        cpu_ms = cpu.per_task_ms(cpu_before, cpu.snapshot(ctx.fleet.main_pids()), len(spans))
    finally:
        ctx.fleet.stop_consuming(queue, workers)
    stats.check_complete(spans, range(count))
    return Run(
        keys=dict(enumerate(ids)),
        spans=spans,
        released_at=released_at,
        submit_rate=rate,
        cpu_ms=cpu_ms,
    )
