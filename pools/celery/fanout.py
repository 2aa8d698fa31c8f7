"""Fan-out in one transaction: ``pools.enqueue_many`` and groups of pooled calls.

Celery still builds every message, one by one, as it publishes it (the gate's
``send_task``, :mod:`pools.celery.gate`); while a batch collects, the gate hands each
pooled call's submission to the batch instead of a transaction of its own
(:data:`pools.celery.sending.batch`). At the end the batch is enqueued by
:func:`pools.core.fanout.enqueue_many`: one transaction, atomic (every call or none).

A group (and so a chord's header, which Celery applies as a group) collects its members
in ``group._apply_tasks``, the one loop where Celery applies them; :func:`install` wraps
it. Members that are not pooled are published by Celery at once, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from celery import Celery, current_app
from celery.canvas import Signature, group
from celery.result import AsyncResult

from pools.celery import refusals, sending
from pools.celery.default_pool import default_spec
from pools.celery.task_specs import spec_for
from pools.core import fanout, locking
from pools.core.records import Enqueued, Submission
from pools.exceptions import PoolConfigurationError, PoolUnavailable, UnknownPool

_original_apply_tasks: Callable[..., Any] | None = None


def install() -> None:
    """Wrap ``group._apply_tasks`` once per process (idempotent)."""
    global _original_apply_tasks
    if _original_apply_tasks is not None:
        return
    _original_apply_tasks = group._apply_tasks  # type: ignore[attr-defined]  # not in celery-types
    group._apply_tasks = _apply_tasks  # type: ignore[attr-defined]


def _apply_tasks(
    self: group, tasks: Any, producer: Any = None, app: Any = None, p: Any = None, **options: Any
) -> Iterator[Any]:
    """Celery's loop over a group's members, their pooled calls enqueued as one batch.

    Celery consumes this generator at once (``list(...)`` in ``group.apply_async``), so
    the batch is enqueued before the group's result is returned; a refusal is raised
    from there, with nothing of the batch's pooled calls enqueued.
    """
    assert _original_apply_tasks is not None
    with collecting() as subs:
        results = list(_original_apply_tasks(self, tasks, producer, app, p, **options))
    if subs:
        enqueue_collected(subs)
    yield from results


@contextmanager
def collecting() -> Iterator[list[Submission] | None]:
    """Collect the pooled calls sent inside the block; ``None`` inside an outer batch
    (which then enqueues them with its own)."""
    if sending.batch.get() is not None:
        yield None
        return
    subs: list[Submission] = []
    token = sending.batch.set(subs)
    try:
        yield subs
    finally:
        sending.batch.reset(token)


def enqueue_collected(subs: Sequence[Submission]) -> list[Enqueued]:
    """Enqueue a collected batch; refusals as a single call raises them.

    A per-key or cap pool the sweep retired between its creation and the batch's locks
    is created again once, as for a single call.
    """
    try:
        try:
            return fanout.enqueue_many(subs)
        except UnknownPool as exc:
            if not any(exc.pool in s.spec.templates or exc.pool in s.spec.caps for s in subs):
                raise
            for sub in subs:
                sending.ensure_pools(sub.spec, again=True)
            return fanout.enqueue_many(subs)
    except PoolUnavailable:
        locking.drop_broken_connection()
        raise
    except Exception as exc:
        refused = refusals.as_pool_error(exc, subs[0].task_name)
        if refused is None or refused is exc:
            raise
        raise refused from exc


def enqueue_many(calls: Iterable[Any], *, app: Celery | None = None) -> list[AsyncResult]:
    """Send many pooled calls as one batch; their ``AsyncResult`` in order.

    Each call is a signature (``task.s(1, 2)``, ``task.signature(..., options)``) or a
    tuple ``(task, args)``, ``(task, args, kwargs)`` or ``(task, args, kwargs, options)``
    where ``task`` is a task or a registered task name and ``options`` are
    ``apply_async``'s. Every call must be of a pooled task.

    Atomic: every call is enqueued or, when one is refused (``PoolFull``,
    ``UnknownPool``, ...), none is and that refusal is raised. Bad input (an item that is
    not a call, a task that is not pooled) raises ``TypeError`` /
    :class:`~pools.exceptions.PoolConfigurationError` before anything is built or sent.
    A call whose idempotency key is held by an unfinished entry gets that entry's result.
    """
    app = app or current_app
    signatures = [_signature(app, call, index) for index, call in enumerate(calls)]
    for index, sig in enumerate(signatures):
        _require_pooled(app, sig, index)
    with collecting() as subs:
        results = [sig.apply_async() for sig in signatures]
    if subs is None:  # inside a group or another batch: enqueued with it
        return results
    enqueued = {s.key: e for s, e in zip(subs, enqueue_collected(subs), strict=True)}
    return [
        app.AsyncResult(enqueued[r.id].key)
        if r.id in enqueued and not enqueued[r.id].created
        else r
        for r in results
    ]


def _signature(app: Celery, call: Any, index: int) -> Signature:
    if isinstance(call, Signature):
        task = str(call.get("task") or "")
        if not task or task.startswith("celery."):  # a group, chain or chord
            raise TypeError(
                f"enqueue_many: call {index} is a {type(call).__name__.lstrip('_')}; give "
                f"single task signatures (send a workflow with apply_async(): the pooled "
                f"members of its groups are enqueued as one batch)."
            )
        return call
    if isinstance(call, tuple) and 2 <= len(call) <= 4:
        task, args, kwargs, options = (*call, None, None)[:4]
        name = task if isinstance(task, str) else getattr(task, "name", None)
        if not isinstance(name, str) or not isinstance(args, (list, tuple)):
            raise TypeError(
                f"enqueue_many: call {index} must be (task, args[, kwargs[, options]]) with a "
                f"task or task name and a list or tuple of arguments; got {call!r:.200}"
            )
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(
                f"enqueue_many: call {index}'s kwargs must be a dict, got {kwargs!r:.200}"
            )
        if options is not None and not isinstance(options, dict):
            raise TypeError(
                f"enqueue_many: call {index}'s options must be a dict, got {options!r:.200}"
            )
        return app.signature(name, args=tuple(args), kwargs=kwargs or {}, options=options or {})
    raise TypeError(
        f"enqueue_many: call {index} must be a task signature or a (task, args[, kwargs[, "
        f"options]]) tuple; got {call!r:.200}"
    )


def _require_pooled(app: Celery, sig: Signature, index: int) -> None:
    name = str(sig.task)
    options = dict(sig.options)
    pooled = spec_for(app, name)
    if pooled is None:
        pooled = default_spec(app, name, sig.args, sig.kwargs, options)
    if pooled is None:
        raise PoolConfigurationError(
            f"enqueue_many: call {index} is of task {name!r}, which is not pooled. Decorate it "
            f"with @pooled or list it in POOLS['TASKS'], or send it with apply_async()."
        )
