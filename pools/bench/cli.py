"""The ``bench`` subcommand's arguments, and the bridge from them to :mod:`pools.bench.runner`."""

from __future__ import annotations

from argparse import ArgumentParser, ArgumentTypeError
from pathlib import Path
from typing import Any

from pools.bench.context import EMBEDDED_SIZES, FULL_SIZES, PRESETS, WORKLOADS, Options

DEFAULTS = Options()


def _ints(value: str) -> tuple[int, ...]:
    try:
        numbers = tuple(int(v.replace("_", "")) for v in value.split(",") if v.strip())
    except ValueError as exc:
        raise ArgumentTypeError(f"expected numbers separated by commas, got {value!r}") from exc
    if not numbers or min(numbers) < 1:
        raise ArgumentTypeError("expected positive numbers")
    return numbers


def _positive(value: str) -> int:
    try:
        number = int(value.replace("_", ""))
    except ValueError as exc:
        raise ArgumentTypeError(f"expected a number, got {value!r}") from exc
    if number < 1:
        raise ArgumentTypeError("expected a positive number")
    return number


def _workloads(value: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in value.split(",") if v.strip())
    canon = {w.lower(): w for w in WORKLOADS}
    unknown = [n for n in names if n.lower() not in canon]
    if unknown or not names:
        raise ArgumentTypeError(
            f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}"
        )
    return tuple(canon[n.lower()] for n in names)


#: Options whose default depends on the preset (see :data:`pools.bench.context.PRESETS`).
SIZES = tuple(FULL_SIZES)


def _size_help(name: str, text: str) -> str:
    return (
        f"{text} (default {getattr(DEFAULTS, name)}, on SQLite {EMBEDDED_SIZES[name]}; "
        f"--full: {FULL_SIZES[name]})"
    )


def add_arguments(parser: ArgumentParser) -> None:
    """The options of ``manage.py pools bench``."""
    d = DEFAULTS
    parser.add_argument(
        "--workloads",
        type=_workloads,
        default=d.workloads,
        help=f"comma-separated, from {','.join(WORKLOADS)} "
        f"(default: {','.join(d.workloads)}; 'rates' runs when named)",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="the full sizes (5000 W1 tasks, 500 in W2/W3/W5, ...) for every size option "
        "not given; several times slower than the defaults, which take a few minutes",
    )
    parser.add_argument("--reps", type=_positive, default=d.reps, help=f"repetitions ({d.reps})")
    parser.add_argument(
        "--tasks", type=_positive, default=None, help=_size_help("tasks", "W1 no-op tasks")
    )
    parser.add_argument(
        "--slow-tasks",
        type=_positive,
        default=None,
        help=_size_help("slow_tasks", "W1 tasks with a 20 ms body"),
    )
    parser.add_argument(
        "--handoff-tasks",
        type=_positive,
        default=None,
        help=_size_help("handoff_tasks", "W2 tasks behind a 1-slot pool"),
    )
    parser.add_argument(
        "--depths",
        type=_ints,
        default=d.depths,
        help="W3 entries already waiting (1000,10000,100000)",
    )
    parser.add_argument(
        "--depth-tasks",
        type=_positive,
        default=None,
        help=_size_help("depth_tasks", "W3 tasks timed at each depth"),
    )
    parser.add_argument(
        "--many-tasks",
        type=_positive,
        default=None,
        help=_size_help("many_tasks", "W4 tasks over 100 pools and over the multi-pool mix"),
    )
    parser.add_argument(
        "--recipe-tasks",
        type=_positive,
        default=None,
        help=_size_help("recipe_tasks", "W5 tasks per body kind"),
    )
    parser.add_argument(
        "--recipe-limit",
        type=_positive,
        default=None,
        help="W5 slots / semaphore size (default: half the total concurrency)",
    )
    parser.add_argument(
        "--recipe-ttl",
        type=float,
        default=d.recipe_ttl,
        help=f"TTL of the recipe's semaphore entries, seconds ({d.recipe_ttl:g})",
    )
    parser.add_argument(
        "--recipe-redis",
        default=None,
        help="Redis URL for the recipe's semaphore (default: the broker)",
    )
    parser.add_argument(
        "--memory-tasks",
        type=_positive,
        default=None,
        help=_size_help("memory_tasks", "tasks each memory worker runs before RSS is read"),
    )
    parser.add_argument(
        "--rate-tasks",
        type=_positive,
        default=d.rate_tasks,
        help=f"rates: tasks through the 20/s pool and through Celery's rate_limit ({d.rate_tasks})",
    )
    parser.add_argument(
        "--workers", type=_positive, default=d.workers, help=f"main workers ({d.workers})"
    )
    parser.add_argument(
        "--concurrency",
        type=_positive,
        default=d.concurrency,
        help=f"prefork processes per worker ({d.concurrency})",
    )
    parser.add_argument(
        "--submit-sample",
        type=_positive,
        default=None,
        help=_size_help(
            "submit_sample",
            "W1 pooled calls per backlog sent through apply_async; "
            "the rest are bulk copies of the same entry",
        ),
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=d.timeout,
        help=f"seconds one step may take ({d.timeout:g})",
    )
    parser.add_argument(
        "--app", default=None, help="Celery app for 'celery -A' (default: the settings' package)"
    )
    parser.add_argument(
        "--worker-args",
        default=d.worker_args,
        help="extra 'celery worker' arguments for every benchmark worker, as one string "
        "(e.g. '--disable-prefetch')",
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


def options_from(values: dict[str, Any], *, embedded: bool = False) -> Options:
    """Build :class:`Options` from parsed arguments (other keys are ignored).

    A size left out (``None``) takes the preset's: ``full`` with ``--full``, else ``embedded``
    on the embedded stack (SQLite), else the :class:`Options` default.
    """
    fields = set(Options.__dataclass_fields__)
    chosen = {k: v for k, v in values.items() if k in fields - {"preset"} and v is not None}
    preset = "full" if values.get("full") else "embedded" if embedded else "default"
    for name, size in PRESETS.get(preset, {}).items():
        chosen.setdefault(name, size)
    return Options(**chosen, preset=preset)


def embedded_stack() -> bool:
    """True on SQLite, the embedded default (its sizes are smaller: see ``PRESETS``)."""
    from django.db import connection

    return connection.vendor == "sqlite"


def run(values: dict[str, Any], stdout: Any = None) -> dict[str, Any]:
    """Run the benchmark with parsed arguments."""
    from pools.bench import runner

    return runner.run(options_from(values, embedded=embedded_stack()), stdout)
