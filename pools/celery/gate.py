"""Installs the gate: Celery's ``send_task`` and ``Control.revoke`` are wrapped once.

* ``Celery.send_task`` becomes :func:`pools.celery.sending.gated_send_task`: a call to a
  pooled task is put in line instead of published;
* ``Control.revoke`` (``AsyncResult.revoke()``, ``app.control.revoke()``) also cancels
  waiting entries;
* ``Control.purge`` also cancels entries whose held messages went with the queue
  (:mod:`pools.celery.purge`).

Celery's own methods stay reachable in :mod:`pools.celery.originals`. Admitted entries
are published by the bridge (:mod:`pools.celery.bridge`).
"""

from __future__ import annotations

from typing import Any

from celery.app import base as celery_base
from celery.app import control

from pools.celery import originals, purge
from pools.celery.bridge import bridge as bridge  # POOLS["PUBLISHER"]'s path in 0.1.0
from pools.celery.sending import gated_send_task
from pools.core import admission


def install() -> None:
    """Wrap ``Celery.send_task`` and ``Control.revoke`` once per process (idempotent)."""
    if originals.kept():
        return
    originals.keep(celery_base.Celery.send_task, control.Control.revoke)
    celery_base.Celery.send_task = gated_send_task  # type: ignore[method-assign,assignment]
    control.Control.revoke = _revoke  # type: ignore[method-assign]
    purge.install()


def _revoke(self: Any, task_id: Any, *args: Any, **kwargs: Any) -> Any:
    """``AsyncResult.revoke()`` / ``app.control.revoke()`` also cancel waiting entries."""
    for key in [task_id] if isinstance(task_id, str) else list(task_id or ()):
        admission.cancel_if_waiting(key, reason="revoked")
    return originals.revoke(self, task_id, *args, **kwargs)
