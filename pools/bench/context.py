"""What one benchmark run knows: its options, the Celery app, its workers, what it created."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pools.bench.workers import Fleet, Worker

#: Every workload, in the order they run.
WORKLOADS = ("W1", "W2", "W3", "W4", "W5", "memory", "rates")
#: The workloads a run without ``--workloads`` runs (``rates`` is asked for by name).
DEFAULT_WORKLOADS = WORKLOADS[:-1]


#: The sizes, by preset. ``default`` (the :class:`Options` defaults, on PostgreSQL and other
#: server databases) keeps W2's 500 tasks and W3's depths but times fewer tasks elsewhere, so
#: that a whole default run takes a few minutes on a 2-core machine. ``embedded`` is the
#: default on SQLite (the embedded stack, W6: its broker polls, so every hand-off costs
#: ~100 ms and a 500-task line alone takes a minute). ``full`` (``--full``) is the whole
#: size: 5,000 / 1,000 W1 tasks, 500 in W2, W3 and W5, 1,000 in W4. Every size is also an
#: option of its own, which wins over the preset.
EMBEDDED_SIZES: dict[str, int] = {
    "tasks": 500,
    "slow_tasks": 200,
    "handoff_tasks": 100,
    "depth_tasks": 100,
    "many_tasks": 100,
    "recipe_tasks": 100,
    "memory_tasks": 100,
    "submit_sample": 50,
}
FULL_SIZES: dict[str, int] = {
    "tasks": 5000,
    "slow_tasks": 1000,
    "handoff_tasks": 500,
    "depth_tasks": 500,
    "many_tasks": 1000,
    "recipe_tasks": 500,
    "memory_tasks": 500,
    "submit_sample": 200,
}
PRESETS: dict[str, dict[str, int]] = {"embedded": EMBEDDED_SIZES, "full": FULL_SIZES}


@dataclass(frozen=True, kw_only=True)
class Options:
    """The command-line options of ``manage.py pools bench``.

    The defaults are sized so that a whole run (every workload, 3 repetitions) takes a few
    minutes on a 2-core machine; see :data:`PRESETS` for the other sizes.
    """

    #: Workloads to run, from :data:`WORKLOADS`.
    workloads: tuple[str, ...] = DEFAULT_WORKLOADS
    #: Repetitions of each measurement (the report shows the median, min and max).
    reps: int = 3
    #: W1: no-op tasks per repetition; and tasks with a 20 ms body.
    tasks: int = 1000
    slow_tasks: int = 500
    #: W2: tasks queued behind a 1-slot pool.
    handoff_tasks: int = 500
    #: W3: entries already waiting; tasks timed at each depth.
    depths: tuple[int, ...] = (1000, 10000, 100000)
    depth_tasks: int = 200
    #: W4: tasks spread over 100 pools, and over the multi-pool mix.
    many_tasks: int = 200
    #: W5: tasks per body kind; the limit (default: half the total concurrency); recipe TTL.
    recipe_tasks: int = 200
    recipe_limit: int | None = None
    recipe_ttl: float = 60.0
    #: Redis URL of the recipe's semaphore (default: the broker, if it is Redis).
    recipe_redis: str | None = None
    #: Memory: tasks each memory worker runs before its RSS is read.
    memory_tasks: int = 300
    #: ``rates``: tasks through the ``"20/s"`` pool, and through Celery's ``rate_limit``.
    rate_tasks: int = 300
    #: Main workers and the prefork concurrency of each.
    workers: int = 2
    concurrency: int = 4
    #: W1: pooled calls per backlog submitted through ``apply_async`` (the rest are bulk
    #: copies); the other workloads send a few (:data:`pools.bench.runs.REAL_CALLS`).
    submit_sample: int = 100
    #: Seconds a single step may take before the run gives up.
    timeout: float = 600.0
    #: Celery app for ``celery -A`` (default: the settings module's package).
    app: str | None = None
    #: Extra ``celery worker`` arguments for every benchmark worker (e.g. ``--disable-prefetch``).
    worker_args: str = ""
    out: Path = Path("bench-results")
    seed: int = 1
    #: No plots (matplotlib not needed).
    no_plots: bool = False
    #: Keep the bench pools, entries, events and results for inspection (workers still stop).
    keep: bool = False
    #: Where the sizes not given explicitly came from: ``default`` or a key of :data:`PRESETS`.
    preset: str = "default"

    @property
    def total_concurrency(self) -> int:
        """Pool processes over all main workers."""
        return self.workers * self.concurrency

    def as_dict(self) -> dict[str, Any]:
        """Every option, JSON-ready (paths as strings, tuples as lists)."""
        out: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, Path):
                value = str(value)
            elif isinstance(value, tuple):
                value = list(value)
            out[name] = value
        return out

    def command_line(self) -> str:
        """The options as ``pools bench`` arguments (every size spelled out)."""
        parts: list[str] = []
        for name, value in self.as_dict().items():
            flag = "--" + name.replace("_", "-")
            if name == "preset":  # the sizes are spelled out
                continue
            if isinstance(value, bool):
                if value:
                    parts.append(flag)
            elif value is None or value == "":
                continue
            elif isinstance(value, list):
                parts.append(f"{flag} {','.join(str(v) for v in value)}")
            else:
                shown = f"{value:g}" if isinstance(value, float) else shlex.quote(str(value))
                parts.append(f"{flag} {shown}")
        return " ".join(parts)


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
