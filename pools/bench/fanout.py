"""Fan-out from outside: the caller's time to submit N pooled calls (docs/benchmarks.md).

Run against a scratch database and a Redis broker (nothing consumes the queue it sends to)::

    POOLS_TEST_DB=postgres POOLS_PG_NAME=bench_fanout DJANGO_SETTINGS_MODULE=tests.settings \\
    CELERY_BROKER_URL=redis://127.0.0.1:6379/9 CELERY_RESULT_BACKEND=redis://127.0.0.1:6379/9 \\
        python -m pools.bench.fanout --migrate [--calls 1000] [--reps 5] [--big 10000]

For each way of sending ``--calls`` calls it times, on the caller's clock, the whole
submit (Celery building each message, the gate, the database, and publishing what is
admitted), ``--reps`` times, in turns so that the machine's load falls on every way alike:

* ``plain group`` / ``plain delay loop``: an undecorated task, plain Celery to the broker;
* ``pooled group``: ``group(...).apply_async()`` of a pooled task (one batch);
* ``pooled group, one transaction per call``: the same with the fan-out hook taken out
  for the run (what a group cost before);
* ``enqueue_many``: ``pools.enqueue_many([...])`` (one batch);
* ``pooled delay loop``: ``delay`` in a loop (one transaction per call, as before).

The pool has ``--slots`` slots (8), so that many messages are published per submit. Then
``--big`` calls in one ``enqueue_many``: its time, and its peak memory in a second run
under ``tracemalloc`` (Python allocations) with the process's peak RSS (``VmHWM``)
before and after. Between runs the queue is purged and the pool's rows deleted. Prints
the figures as JSON (median, min, max seconds; ratios to the plain figure of the same kind).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

#: The queue the calls are sent to (no worker consumes it; purged after each run).
QUEUE = "pools-bench-fanout"


def _vm_hwm_kb() -> int:
    """Peak resident set size of this process so far (``/proc/self/status``), in kB."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _reset(pool: str, slots: int, app: Any) -> None:
    from pools.models import Pool, PoolEvent, QueueEntry

    QueueEntry.objects.filter(demand__has_key=pool).delete()
    PoolEvent.objects.filter(pool=pool).delete()
    Pool.objects.filter(name=pool).delete()
    Pool.objects.create(name=pool, slots=slots)
    with app.connection_for_write() as conn:
        conn.default_channel.queue_purge(QUEUE)


def _ways(n: int) -> dict[str, Callable[[], Any]]:
    from celery import group

    import pools
    from pools.bench.tasks import POOLED, W1_POOL, plain

    pooled = POOLED[W1_POOL]

    def plain_group() -> Any:
        return group(plain.s(i).set(queue=QUEUE) for i in range(n)).apply_async()

    def plain_loop() -> Any:
        return [plain.apply_async((i,), queue=QUEUE) for i in range(n)]

    def pooled_group() -> Any:
        return group(pooled.s(i).set(queue=QUEUE) for i in range(n)).apply_async()

    def pooled_group_per_call() -> Any:
        # As before fan-out: Celery's own loop, one transaction per member.
        from pools.celery import fanout

        group._apply_tasks = fanout._original_apply_tasks  # type: ignore[attr-defined]
        try:
            return pooled_group()
        finally:
            group._apply_tasks = fanout._apply_tasks  # type: ignore[attr-defined]

    def many() -> Any:
        return pools.enqueue_many([pooled.s(i).set(queue=QUEUE) for i in range(n)])

    def pooled_loop() -> Any:
        return [pooled.apply_async((i,), queue=QUEUE) for i in range(n)]

    return {
        "plain group": plain_group,
        "pooled group": pooled_group,
        "pooled group, one transaction per call": pooled_group_per_call,
        "enqueue_many": many,
        "plain delay loop": plain_loop,
        "pooled delay loop": pooled_loop,
    }


def measure(calls: int, reps: int, slots: int, big: int, app: Any) -> dict[str, Any]:
    """The figures (see the module docstring)."""
    from pools.bench.tasks import W1_POOL
    from pools.models import QueueEntry

    ways = _ways(calls)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for name in ways:  # warm-up: imports, connections, prepared statements
        _reset(W1_POOL, slots, app)
        _ways(5)[name]()
    for _ in range(reps):
        for name, way in ways.items():
            _reset(W1_POOL, slots, app)
            start = time.perf_counter()
            way()
            times[name].append(time.perf_counter() - start)
            if "pooled" in name or name == "enqueue_many":
                entries = QueueEntry.objects.filter(demand__has_key=W1_POOL).count()
                assert entries == calls, f"{name}: {entries} entries, expected {calls}"
    out: dict[str, Any] = {
        "calls": calls,
        "reps": reps,
        "slots": slots,
        "load_average": os.getloadavg(),
        "seconds": {
            name: {
                "median": round(statistics.median(t), 3),
                "min": round(min(t), 3),
                "max": round(max(t), 3),
            }
            for name, t in times.items()
        },
    }
    med = {name: statistics.median(t) for name, t in times.items()}
    out["ratio_to_plain"] = {
        "pooled group / plain group": round(med["pooled group"] / med["plain group"], 2),
        "enqueue_many / plain group": round(med["enqueue_many"] / med["plain group"], 2),
        "pooled group one transaction per call / plain group": round(
            med["pooled group, one transaction per call"] / med["plain group"], 2
        ),
        "pooled delay loop / plain delay loop": round(
            med["pooled delay loop"] / med["plain delay loop"], 2
        ),
    }
    if big:
        out["big"] = _big(big, slots, app)
    _reset(W1_POOL, slots, app)
    out["load_average_end"] = os.getloadavg()
    return out


def _big(n: int, slots: int, app: Any) -> dict[str, Any]:
    """``n`` calls in one ``enqueue_many``: time, then peak memory under tracemalloc."""
    from pools.bench.tasks import W1_POOL
    from pools.models import QueueEntry

    many = _ways(n)["enqueue_many"]
    _reset(W1_POOL, slots, app)
    hwm_before = _vm_hwm_kb()
    held: list[float] = []
    with _timed_locks(held):
        start = time.perf_counter()
        many()
        seconds = time.perf_counter() - start
    hwm_after = _vm_hwm_kb()
    entries = QueueEntry.objects.filter(demand__has_key=W1_POOL).count()
    _reset(W1_POOL, slots, app)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    many()
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "calls": n,
        "entries": entries,
        "seconds": round(seconds, 3),
        "pool_lock_held_seconds": [round(h, 3) for h in held],
        "tracemalloc_peak_mb": round((peak - base) / 2**20, 1),
        "tracemalloc_peak_bytes_per_call": round((peak - base) / n),
        "tracemalloc_left_after_mb": round((current - base) / 2**20, 1),
        "vm_hwm_before_mb": round(hwm_before / 1024, 1),
        "vm_hwm_after_mb": round(hwm_after / 1024, 1),
    }


@contextmanager
def _timed_locks(held: list[float]) -> Iterator[None]:
    """Time each transaction the batch holds its pools' locks in (appended to ``held``)."""
    from pools.core import fanout

    real = fanout.locked_pools

    @contextmanager
    def timed(names: Any) -> Iterator[Any]:
        start = time.perf_counter()
        with real(names) as pools:
            yield pools
        held.append(time.perf_counter() - start)

    fanout.locked_pools = timed
    try:
        yield
    finally:
        fanout.locked_pools = real


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    import django

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--big", type=int, default=10000, help="0: skip the big batch")
    parser.add_argument("--app", default="tests.celery_app:app", help="the Celery app")
    parser.add_argument("--migrate", action="store_true", help="run migrate first")
    args = parser.parse_args(argv)
    django.setup()
    from celery.utils.imports import symbol_by_name

    app = symbol_by_name(args.app)
    import pools.bench.tasks  # noqa: F401  (registers the bench tasks)

    if args.migrate:
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
    print(json.dumps(measure(args.calls, args.reps, args.slots, args.big, app), indent=2))


if __name__ == "__main__":
    main()
