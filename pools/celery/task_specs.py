"""Which pool spec a task has: its ``@pooled``, else ``POOLS['TASKS']``, else none.

On a worker, the tasks pooled without the decorator (named in ``POOLS['TASKS']``, or in
the default pool by their queue) are gated before the pool forks, so that no body of
theirs runs without a claim.
"""

from __future__ import annotations

import difflib
import logging
from typing import Any

from celery import Celery, signals

from pools import conf
from pools.celery.decorators import gate_task, spec_of
from pools.celery.default_pool import DEFAULT_GATED, NEVER_DEFAULT
from pools.core import definitions
from pools.specs import PoolSpec

#: The gate's logger (send side and task gating), named as before the gate was split.
logger = logging.getLogger("pools.celery.gate")


def spec_for(app: Celery, name: str, task_type: Any = None) -> PoolSpec | None:
    """The pool spec of task ``name``: from the task's decorator, else ``POOLS['TASKS']``."""
    if task_type is None:
        task_type = app._tasks.get(name)  # type: ignore[attr-defined]  # raw registry: no finalize
        unfinalized = not getattr(app, "finalized", True)  # not in celery-types' stubs
        if task_type is None and unfinalized and getattr(app, "autofinalize", True):
            # @shared_task tasks join an app's registry when it is finalized. A process whose
            # app is not finalized yet (a web process that only calls send_task by name)
            # would otherwise send a pooled task around the gate.
            app.finalize(auto=True)
            task_type = app._tasks.get(name)  # type: ignore[attr-defined]
    spec = spec_of(task_type) if task_type is not None else None
    if spec is not None and name in DEFAULT_GATED:
        spec = None  # gated here for the default pool only: decided by the call's queue
    if spec is None:
        declared = conf.get().TASKS.get(name)
        if declared is not None:
            spec = PoolSpec.from_dict(declared)
    return spec


def pool_default_tasks(app: Celery) -> list[str]:
    """Gate every local task without a spec for the default pool (worker side).

    The body then runs only under a claim when its delivery comes from a default-pool
    queue (:func:`pools.celery.worker.run_gated` asks
    :func:`pools.celery.default_pool.is_default_queue`); from another queue it runs as
    before.
    """
    default = definitions.default_pool()
    if default is None:
        return []
    wrapped = []
    for name, task in list(app.tasks.items()):
        if name.startswith(NEVER_DEFAULT) or spec_of(task) is not None:
            continue
        gate_task(task, PoolSpec.build(default.name, 1))
        DEFAULT_GATED.add(name)
        wrapped.append(name)
    return wrapped


def pool_declared_tasks(app: Celery) -> list[str]:
    """Gate the local tasks named in ``POOLS['TASKS']`` that lack the decorator (worker side).

    Without this a worker would run such a task's body without a claim.
    """
    wrapped = []
    for name, declared in conf.get().TASKS.items():
        task = app.tasks.get(name)
        if task is None:
            # Most likely a misspelt name: the real task would run unpooled, silently.
            logger.warning(
                "POOLS['TASKS'] names %r, which this worker does not know (registered tasks "
                "with a similar name: %s); calls of it are not pooled. Check the spelling.",
                name,
                ", ".join(_similar(name, app.tasks.keys())) or "none",
            )
        elif spec_of(task) is None:
            gate_task(task, PoolSpec.from_dict(declared))
            wrapped.append(name)
    return wrapped


@signals.worker_init.connect(dispatch_uid="pools.celery.gate.declared_tasks")
def _gate_declared_tasks(sender: Any = None, **kwargs: Any) -> None:
    """Before the pool forks: gate tasks pooled only by name in ``POOLS['TASKS']``."""
    app = getattr(sender, "app", None)
    if app is not None:
        app.loader.import_default_modules()
        for name in pool_declared_tasks(app):
            logger.info("Task %s is pooled by POOLS['TASKS']", name)
        for name in pool_default_tasks(app):
            logger.debug("Task %s is pooled by POOLS['DEFAULT_POOL'] on its queues", name)


def _similar(name: str, names: Any) -> list[str]:
    return difflib.get_close_matches(name, [n for n in names if not n.startswith("celery.")], 3)
