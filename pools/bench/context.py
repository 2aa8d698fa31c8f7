"""What one benchmark run knows: its options, the Celery app, its workers, what it created."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pools.bench.workers import Fleet, Worker

#: Every workload, in the order they run.
WORKLOADS = ("W1", "W2", "W3", "W4", "W5", "memory")


@dataclass(frozen=True, kw_only=True)
class Options:
    """The command-line options of ``manage.py pools bench``."""

    #: Workloads to run, from :data:`WORKLOADS`.
    workloads: tuple[str, ...] = WORKLOADS
    #: Repetitions of each measurement (the report shows the median, min and max).
    reps: int = 3
    #: W1: no-op tasks per repetition; and tasks with a 20 ms body.
    tasks: int = 5000
    slow_tasks: int = 1000
    #: W2: tasks queued behind a 1-slot pool.
    handoff_tasks: int = 500
    #: W3: entries already waiting; tasks timed at each depth.
    depths: tuple[int, ...] = (1000, 10000, 100000)
    depth_tasks: int = 500
    #: W4: tasks spread over 100 pools, and over the multi-pool mix.
    many_tasks: int = 1000
    #: W5: tasks per body kind; the limit (default: half the total concurrency); recipe TTL.
    recipe_tasks: int = 500
    recipe_limit: int | None = None
    recipe_ttl: float = 60.0
    #: Redis URL of the recipe's semaphore (default: the broker, if it is Redis).
    recipe_redis: str | None = None
    #: Memory: tasks each memory worker runs before its RSS is read.
    memory_tasks: int = 500
    #: Main workers and the prefork concurrency of each.
    workers: int = 2
    concurrency: int = 4
    #: Pooled calls per backlog submitted through ``apply_async`` (the rest are bulk copies).
    submit_sample: int = 200
    #: Seconds a single step may take before the run gives up.
    timeout: float = 600.0
    #: Celery app for ``celery -A`` (default: the settings module's package).
    app: str | None = None
    out: Path = Path("bench-results")
    seed: int = 1
    #: No plots (matplotlib not needed).
    no_plots: bool = False
    #: Keep the bench pools, entries, events and results for inspection (workers still stop).
    keep: bool = False

    @property
    def total_concurrency(self) -> int:
        """Pool processes over all main workers."""
        return self.workers * self.concurrency


@dataclass(kw_only=True)
class Context:
    """One run: options, app, workers, and every task id it created (to forget the results)."""

    options: Options
    app: Any
    app_path: str
    fleet: Fleet
    run_id: str
    main: list[Worker] = field(default_factory=list)
    floor: Worker | None = None
    mem_plain: Worker | None = None
    mem_pooled: Worker | None = None
    task_ids: list[str] = field(default_factory=list)
    #: Redis keys of the recipe's semaphores.
    semaphores: list[str] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def track(self, ids: list[str]) -> list[str]:
        """Remember task ids whose results must be forgotten at the end."""
        self.task_ids.extend(ids)
        return ids
