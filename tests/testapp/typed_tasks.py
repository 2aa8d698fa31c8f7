"""Tasks of the typed-arguments acceptance test: each says exactly what its body received.

A pooled task and its plain twin must return the same text for the same call. Every body
also appends its task id to the run log named by ``POOLS_TEST_RUNLOG`` (one line per
run, ``O_APPEND``), so the test can count runs per call.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import current_task, shared_task

from pools import pooled

#: One pool per way an entry can be admitted (created by the test, not in settings).
FREE = "typed-free"  # roomy: admitted at enqueue
LINE = "typed-line"  # 1 slot behind a holder: admitted by another worker's settle
PAUSED = "typed-paused"  # paused, then admitted by the sweep
DUE = "typed-due"  # countdown: admitted by a timed wake-up
MULTI_A, MULTI_B = "typed-multi-a", "typed-multi-b"  # a multi-pool demand
TYPED_POOLS = {FREE: 50, LINE: 1, PAUSED: 2, DUE: 50, MULTI_A: 1, MULTI_B: 2}


def described(args: Any, kwargs: Any) -> str:
    """The arguments as the body got them: values and their types, nested."""
    return f"{_shape(list(args))} {_shape(dict(kwargs))}"


def _shape(value: Any) -> str:
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_shape(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_shape(v)}" for k, v in sorted(value.items())) + "}"
    return f"{type(value).__name__}:{value!r}"


def _ran(args: Any, kwargs: Any) -> str:
    log = os.environ.get("POOLS_TEST_RUNLOG")
    if log and current_task:
        with open(log, "a") as out:
            out.write(f"{current_task.request.id}\n")
    return described(args, kwargs)


@shared_task
def plain_echo(*args: Any, **kwargs: Any) -> str:
    """The unpooled twin."""
    return _ran(args, kwargs)


@shared_task
@pooled(FREE)
def free_echo(*args: Any, **kwargs: Any) -> str:
    return _ran(args, kwargs)


@shared_task
@pooled(LINE)
def line_echo(*args: Any, **kwargs: Any) -> str:
    return _ran(args, kwargs)


@shared_task
@pooled(LINE)
def line_holder(seconds: float) -> str:
    """Holds the 1-slot line pool while the typed calls queue behind it."""
    time.sleep(seconds)
    return _ran((seconds,), {})


@shared_task
@pooled(PAUSED)
def paused_echo(*args: Any, **kwargs: Any) -> str:
    return _ran(args, kwargs)


@shared_task
@pooled(DUE)
def due_echo(*args: Any, **kwargs: Any) -> str:
    return _ran(args, kwargs)


@shared_task
@pooled({MULTI_A: 1, MULTI_B: 1})
def multi_echo(*args: Any, **kwargs: Any) -> str:
    return _ran(args, kwargs)


@shared_task
def plain_fail(*args: Any, **kwargs: Any) -> str:
    _ran(args, kwargs)
    raise ValueError("planned failure")


@shared_task
@pooled(FREE)
def pooled_fail(*args: Any, **kwargs: Any) -> str:
    _ran(args, kwargs)
    raise ValueError("planned failure")


@shared_task
def plain_collect(results: list[str], *args: Any, **kwargs: Any) -> str:
    """A chord body: the header's results and the body's own arguments."""
    return f"{sorted(results)} {_ran(args, kwargs)}"


@shared_task
@pooled(LINE)
def pooled_collect(results: list[str], *args: Any, **kwargs: Any) -> str:
    return f"{sorted(results)} {_ran(args, kwargs)}"


@shared_task
def plain_errback(task_id: str, **kwargs: Any) -> str:
    """An old-style ``link_error`` callback (one positional argument: the failed task's id,
    then the signature's own keyword arguments): Celery sends it as a message."""
    return _ran((), kwargs)


@shared_task
@pooled(LINE)
def pooled_errback(task_id: str, **kwargs: Any) -> str:
    return _ran((), kwargs)
