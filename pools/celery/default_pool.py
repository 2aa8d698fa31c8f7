"""Default-pool routing: whether a call, or a delivery, is in the implicit default pool.

With ``POOLS['DEFAULT_POOL']`` on, a task without ``@pooled`` is pooled by the queue its
call is routed to, not by the task: on the send side :func:`default_spec`, on the worker
side :func:`is_default_queue` for the tasks in :data:`DEFAULT_GATED`.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from pools.core import definitions
from pools.specs import PoolSpec

#: Tasks gated on this worker only for the implicit default pool: whether a call of one
#: is pooled depends on the queue it is routed to (:func:`default_spec`), not on the task.
DEFAULT_GATED: set[str] = set()

#: Task name prefixes never put in the default pool (Celery's own and this app's tasks).
NEVER_DEFAULT = ("celery.", "pools.")


def default_spec(
    app: Celery, name: str, args: Any, kwargs: Any, options: dict[str, Any]
) -> PoolSpec | None:
    """The default pool's spec for a call of a task without ``@pooled``, if it applies.

    It applies when ``POOLS['DEFAULT_POOL']`` is on and Celery's router sends the call to
    one of its queues (routing as ``send_task`` will do it: ``queue`` option, task routes,
    the default queue).
    """
    default = definitions.default_pool()
    if default is None or name.startswith(NEVER_DEFAULT):
        return None
    return (
        PoolSpec.build(default.name, 1)
        if _routed_queue(app, name, args, kwargs, options) in default.queues
        else None
    )


def _routed_queue(app: Celery, name: str, args: Any, kwargs: Any, options: dict[str, Any]) -> str:
    routed = app.amqp.router.route(
        {k: v for k, v in options.items() if k in ("queue", "exchange", "routing_key")},
        name,
        args or (),
        kwargs or {},
        options.get("task_type"),
    )
    queue = routed.get("queue")
    return str(getattr(queue, "name", queue) or app.conf.task_default_queue)


def is_default_queue(queue: str) -> bool:
    """True if deliveries from ``queue`` must hold a claim of the default pool."""
    default = definitions.default_pool()
    return default is not None and queue in default.queues
