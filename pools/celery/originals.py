"""Celery's own ``send_task`` and ``Control.revoke``, as they were before the gate's hooks.

:func:`pools.celery.gate.install` keeps them here when it wraps them. What must reach the
broker around the gate (a message admission already granted, the ``pools.admit``
wake-up, a call of a task that is not pooled) goes through :func:`send_task`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery import Celery

_original_send_task: Callable[..., Any] | None = None
_original_revoke: Callable[..., Any] | None = None


def keep(send_task: Callable[..., Any], revoke: Callable[..., Any]) -> None:
    """Remember Celery's methods before the hooks replace them (once per process)."""
    global _original_send_task, _original_revoke
    _original_send_task = send_task
    _original_revoke = revoke


def kept() -> bool:
    """True once :func:`keep` ran: the hooks are installed."""
    return _original_send_task is not None


def send_task(app: Celery, name: str, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
    """Celery's ``send_task``, around the gate."""
    assert _original_send_task is not None, "pools.celery.gate.install() was not called"
    return _original_send_task(app, name, args, kwargs, **options)


def revoke(control: Any, task_id: Any, *args: Any, **kwargs: Any) -> Any:
    """Celery's ``Control.revoke``."""
    assert _original_revoke is not None, "pools.celery.gate.install() was not called"
    return _original_revoke(control, task_id, *args, **kwargs)
