"""The ``@pooled`` decorator: attaches a :class:`~pools.specs.PoolSpec` to a Celery task.

Supported placements (a pooled task is never silently ungated):

* below ``@app.task`` / ``@shared_task`` (the documented order): the function is wrapped;
* above ``@app.task`` (a ``Task`` or a lazy ``PromiseProxy``): the task's ``run`` is wrapped;
* on a class-based task (a ``Task`` subclass): its ``run`` is wrapped.

Above ``@shared_task`` the task does not exist yet (a plain ``Proxy``) and touching
it would finalize the wrong app, so that order raises at import with the fix.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from celery import Task
from celery.local import PromiseProxy, Proxy

from pools.celery import worker
from pools.exceptions import PoolConfigurationError
from pools.specs import SPEC_ATTR, PoolSpec, with_arguments_of
from pools.specs import spec_of as spec_of  # re-exported: the name callers know

T = TypeVar("T")


@with_arguments_of(PoolSpec.build)
def pooled(*args: Any, **options: Any) -> Callable[[T], T]:
    """Limit a Celery task by one or more named resource pools.

    ``@pooled("warehouse", slots=2, priority=10, queue_timeout=1800)`` or
    ``@pooled({"warehouse": 1, "partner-api": 1})``. Arguments are checked now;
    a bad one raises :class:`~pools.exceptions.PoolConfigurationError` at import.

    ``concurrency_policy`` (``allow``, ``forbid``, ``replace``, ``skip``) says what a new
    entry does while another entry of the same job waits or runs; ``job_key`` (a callable
    of the task's arguments) tells jobs of one task apart; ``idempotency_key`` (a callable
    of the task's arguments) makes a submit whose key matches an unfinished entry return
    that entry's result instead of queueing another.

    ``max_running=N`` is a task cap: at most N calls of this task admitted at once, across
    every worker, with or without named pools (``@pooled(max_running=3)``); it is checked
    before the named pools. See :func:`pools.limit_run` for a cap over a whole workflow.
    ``fairness_key`` (a string, or a callable of the task's arguments) says whom a call is
    fair to in pools with strategy ``fair``.

    ``rate="20/s"`` (or a list such as ``["10/s", "100000/d"]``; ``N/s``, ``N/m``, ``N/h``,
    ``N/d``) is a task rate: at most that many calls of this task *started* per sliding
    window, across every worker (the global counterpart of Celery's per-worker
    ``rate_limit``). It lives on the task's own pool with ``max_running``, if given.
    """
    spec = PoolSpec.build(*args, **options)

    def decorate(obj: T) -> T:
        kind = type(obj)  # type(), not isinstance(): a Proxy would evaluate itself
        if kind is PromiseProxy:
            obj.__then__(_wrap_task, obj, spec)  # type: ignore[attr-defined]
            return obj
        if kind is Proxy:
            raise PoolConfigurationError(
                "@pooled must be placed below @shared_task, not above it:\n"
                "    @shared_task\n"
                f"    @pooled({_spec_repr(spec)})\n"
                "    def my_task(...): ..."
            )
        if isinstance(obj, type) and issubclass(obj, Task):
            _wrap_class(obj, spec)
            return obj
        if isinstance(obj, Task):
            _wrap_task(obj, spec)
            return obj
        if callable(obj):
            return _wrap_function(obj, spec)  # type: ignore[return-value]
        raise PoolConfigurationError(f"@pooled can decorate a task or a function, not {obj!r}.")

    return decorate


def _spec_repr(spec: PoolSpec) -> str:
    if len(spec.demand) == 1:
        ((name, slots),) = spec.demand.items()
        return f"{name!r}, slots={slots}"
    return repr(spec.demand)


def _wrap_function(fn: Callable[..., Any], spec: PoolSpec) -> Callable[..., Any]:
    if getattr(fn, SPEC_ATTR, None) is not None:
        raise PoolConfigurationError(f"{fn.__qualname__} is decorated with @pooled twice.")

    @functools.wraps(fn)
    def gated(*args: Any, **kwargs: Any) -> Any:
        return worker.run_gated(fn, args, kwargs)

    # Celery checks call arguments with getfullargspec(), which ignores __wrapped__.
    gated.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
    setattr(gated, SPEC_ATTR, spec)
    return gated


def gate_task(task: Task, spec: PoolSpec) -> None:
    """Apply ``spec`` to an existing task instance (what ``@pooled`` above ``@app.task`` does)."""
    _wrap_task(task, spec)


def _wrap_task(task: Task, spec: PoolSpec) -> None:
    if type(task) in (Proxy, PromiseProxy):
        task = task._get_current_object()  # type: ignore[attr-defined]
    _wrap_class(type(task), spec)
    # Celery's autoretry_for puts a wrapper around the original ``run`` on the instance
    # (``task.run``, calling ``task._orig_run``), which shadows the class's gated ``run``.
    # It is gated as well, unless it already wraps a gated function (@pooled below the
    # task decorator, whose spec functools.wraps copied onto it).
    instance_run = vars(task).get("run")
    if instance_run is not None and getattr(instance_run, SPEC_ATTR, None) is None:
        task.run = _wrap_function(instance_run, spec)  # type: ignore[method-assign]


def _wrap_class(cls: type[Task], spec: PoolSpec) -> None:
    run = cls.__dict__.get("run")
    if run is None:
        raise PoolConfigurationError(f"@pooled needs {cls.__name__} to define run().")
    if isinstance(run, staticmethod):
        cls.run = staticmethod(_wrap_function(run.__func__, spec))  # type: ignore[method-assign]
    else:
        cls.run = _wrap_function(run, spec)  # type: ignore[method-assign]
