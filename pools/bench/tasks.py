"""The task bodies the benchmark's workers run (``celery worker --include pools.bench.tasks``).

Every body returns its own timestamps (:func:`pools.bench.bodies.span`), so the benchmark
counts and times from what the bodies saw, through the project's result backend, whatever
the broker. The recipe's task lives with its semaphore (:mod:`pools.bench.recipe`); this
module imports it, so that ``--include`` registers it too.

One pooled task per bench pool (the pool a task waits in is fixed by its decorator), named
``pools.bench.pooled.<pool>``; :data:`POOLED` maps the pool label to the task.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Task, current_task, shared_task

from pools import current_claim, pooled
from pools.bench import recipe  # noqa: F401  (``--include pools.bench.tasks`` registers it)
from pools.bench.bodies import span

#: Pool of W1 (throughput), W2 (hand-off), W3 (queue depth), W5 (recipe comparison), memory.
W1_POOL = "bench-w1"
W2_POOL = "bench-w2"
W3_POOL = "bench-w3"
W5_POOL = "bench-w5"
MEM_POOL = "bench-mem"
#: W4: many pools with one slot each, and two pools shared by a multi-pool task.
MANY_POOLS = [f"bench-many-{n:03d}" for n in range(100)]
MULTI_A, MULTI_B = "bench-multi-a", "bench-multi-b"
MULTI_AB = f"{MULTI_A}+{MULTI_B}"
#: W5 kill test: one pool per concurrent repetition.
KILL_POOLS = [f"bench-kill-{n}" for n in range(5)]
#: The ``rates`` workload: a pool with a rate (:mod:`pools.bench.rates`).
RATE_POOL = "bench-rate"


def hold_if_first(hold: float) -> None:
    """Kill-test holder: on its first admission, publish its pid and hold the slot ``hold`` s.

    The benchmark SIGKILLs the process while it holds. When the lapsed lease puts the entry
    back in line and it is admitted again (a new fencing token), the body returns at once.
    """
    claim = current_claim()
    if hold > 0 and claim is not None and claim.token == 1:
        current_task.update_state(state="HOLDING", meta={"pid": os.getpid(), "at": time.time()})
        time.sleep(hold)


@shared_task(name="pools.bench.plain")
def plain(i: int, sleep: float = 0.0) -> dict[str, Any]:
    """The same body, undecorated: plain Celery."""
    return span(i, sleep)


@shared_task(name="pools.bench.celery_rated", rate_limit="20/s")
def celery_rated(i: int, sleep: float = 0.0) -> dict[str, Any]:
    """The plain body with Celery's own per-worker ``rate_limit`` (the ``rates`` workload)."""
    return span(i, sleep)


def _pooled_task(label: str, demand: str | dict[str, int]) -> Task:
    @shared_task(name=f"pools.bench.pooled.{label}")
    @pooled(demand)
    def run(i: int, sleep: float = 0.0, hold: float = 0.0) -> dict[str, Any]:
        hold_if_first(hold)
        return span(i, sleep, retries=current_task.request.retries or 0)

    task: Task = run
    return task


def _demand(label: str) -> str | dict[str, int]:
    if "+" in label:
        return {name: 1 for name in label.split("+")}
    return label


#: Pool label (a pool name, or ``a+b`` for a multi-pool demand) -> its pooled task.
POOLED: dict[str, Task] = {
    label: _pooled_task(label, _demand(label))
    for label in [
        W1_POOL,
        W2_POOL,
        W3_POOL,
        W5_POOL,
        MEM_POOL,
        *MANY_POOLS,
        MULTI_A,
        MULTI_B,
        MULTI_AB,
        *KILL_POOLS,
        RATE_POOL,
    ]
}


def pool_names() -> list[str]:
    """Every pool the benchmark may create."""
    return sorted({name for label in POOLED for name in label.split("+")})


#: Set by the benchmark for its workers (:mod:`pools.bench.workers`): route the wake-ups.
WAKEUPS_ENV = "POOLS_BENCH_ROUTE_WAKEUPS"


def route_wakeups(app: Any, queue: str) -> Any:
    """Send the pools' timed wake-ups (``pools.admit``, e.g. when a rate's window opens) to
    ``queue``, a queue the benchmark's workers consume. Returns the routes it replaced,
    for :func:`restore_routes`.

    The wake-up is a ``pools.admit`` message with a countdown on the default queue, which
    the benchmark's workers do not consume (they leave the project's queues alone). Every
    wake-up the benchmark's processes send is for a bench pool: their admission passes only
    ever touch the bench pools.
    """
    route = {"pools.admit": {"queue": queue}}
    existing = app.conf.task_routes
    if not existing:
        chain: tuple[Any, ...] = ()
    elif isinstance(existing, list | tuple):
        chain = tuple(existing)
    else:
        chain = (existing,)
    app.conf.task_routes = (route, *chain)
    app.amqp.flush_routes()
    app.amqp.router = app.amqp.Router()
    return existing


def restore_routes(app: Any, routes: Any) -> None:
    """Put back the routes :func:`route_wakeups` replaced (its return value).

    The benchmark's own process must not keep sending the project's wake-ups to the bench
    queue after the run (a test suite that runs the benchmark goes on with other tests).
    """
    app.conf.task_routes = routes
    app.amqp.flush_routes()
    app.amqp.router = app.amqp.Router()


if os.environ.get(WAKEUPS_ENV):
    from celery import current_app

    route_wakeups(current_app, os.environ[WAKEUPS_ENV])
