"""The ``bench`` subcommand's arguments, and the bridge from them to :mod:`pools.bench.runner`."""

from __future__ import annotations

from argparse import ArgumentParser, ArgumentTypeError
from pathlib import Path
from typing import Any

from pools.bench.context import WORKLOADS, Options

DEFAULTS = Options()


def _ints(value: str) -> tuple[int, ...]:
    try:
        numbers = tuple(int(v.replace("_", "")) for v in value.split(",") if v.strip())
    except ValueError as exc:
        raise ArgumentTypeError(f"expected numbers separated by commas, got {value!r}") from exc
    if not numbers or min(numbers) < 1:
        raise ArgumentTypeError("expected positive numbers")
    return numbers


def _workloads(value: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in value.split(",") if v.strip())
    canon = {w.lower(): w for w in WORKLOADS}
    unknown = [n for n in names if n.lower() not in canon]
    if unknown or not names:
        raise ArgumentTypeError(
            f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}"
        )
    return tuple(canon[n.lower()] for n in names)


def add_arguments(parser: ArgumentParser) -> None:
    """The options of ``manage.py pools bench``."""
    d = DEFAULTS
    parser.add_argument(
        "--workloads",
        type=_workloads,
        default=d.workloads,
        help=f"comma-separated, from {','.join(WORKLOADS)} (default: all)",
    )
    parser.add_argument("--reps", type=int, default=d.reps, help="repetitions (default 3)")
    parser.add_argument("--tasks", type=int, default=d.tasks, help="W1 no-op tasks (5000)")
    parser.add_argument(
        "--slow-tasks", type=int, default=d.slow_tasks, help="W1 tasks with a 20 ms body (1000)"
    )
    parser.add_argument(
        "--handoff-tasks",
        type=int,
        default=d.handoff_tasks,
        help="W2 tasks behind a 1-slot pool (500)",
    )
    parser.add_argument(
        "--depths",
        type=_ints,
        default=d.depths,
        help="W3 entries already waiting (1000,10000,100000)",
    )
    parser.add_argument(
        "--depth-tasks", type=int, default=d.depth_tasks, help="W3 tasks timed at each depth (500)"
    )
    parser.add_argument(
        "--many-tasks",
        type=int,
        default=d.many_tasks,
        help="W4 tasks over 100 pools and over the multi-pool mix (1000)",
    )
    parser.add_argument(
        "--recipe-tasks", type=int, default=d.recipe_tasks, help="W5 tasks per body kind (500)"
    )
    parser.add_argument(
        "--recipe-limit",
        type=int,
        default=None,
        help="W5 slots / semaphore size (default: half the total concurrency)",
    )
    parser.add_argument(
        "--recipe-ttl",
        type=float,
        default=d.recipe_ttl,
        help="TTL of the recipe's semaphore entries, seconds (60)",
    )
    parser.add_argument(
        "--recipe-redis",
        default=None,
        help="Redis URL for the recipe's semaphore (default: the broker)",
    )
    parser.add_argument(
        "--memory-tasks",
        type=int,
        default=d.memory_tasks,
        help="tasks each memory worker runs before RSS is read (500)",
    )
    parser.add_argument("--workers", type=int, default=d.workers, help="main workers (2)")
    parser.add_argument(
        "--concurrency", type=int, default=d.concurrency, help="prefork processes per worker (4)"
    )
    parser.add_argument(
        "--submit-sample",
        type=int,
        default=d.submit_sample,
        help="pooled calls per backlog sent through apply_async (200); "
        "the rest are bulk copies of the same entry",
    )
    parser.add_argument(
        "--timeout", type=float, default=d.timeout, help="seconds one step may take (600)"
    )
    parser.add_argument(
        "--app", default=None, help="Celery app for 'celery -A' (default: the settings' package)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=d.out,
        help="directory for bench.json, the plots and worker logs",
    )
    parser.add_argument("--seed", type=int, default=d.seed, help="seed of the W5 priority mix")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the bench pools, entries, events and results for inspection",
    )


def options_from(values: dict[str, Any]) -> Options:
    """Build :class:`Options` from parsed arguments (other keys are ignored)."""
    fields = set(Options.__dataclass_fields__)
    return Options(**{k: v for k, v in values.items() if k in fields})


def run(values: dict[str, Any], stdout: Any = None) -> dict[str, Any]:
    """Run the benchmark with parsed arguments."""
    from pools.bench import runner

    return runner.run(options_from(values), stdout)
