"""The Celery app of the external worker: a user's ``proj/celery.py`` (docs/quickstart.md).

``celery -A tests.peer.worker_app worker`` with ``POOLS_PEER_MODE=plain`` is a plain
Celery worker of ``t.integration.tasks`` configured from :mod:`tests.peer.settings`
without Django. With any other mode it is the quick start's app: Django's settings
module named, configuration read from ``django.conf:settings`` (namespace ``CELERY``),
tasks autodiscovered; Celery's Django fix-up sets Django up when the worker starts, as in
a user's project, so every task is gated by ``POOLS["TASKS"]``.

Each worker process logs one ``peer-check`` line at its first task: whether the SQL fast
path and pools' own connection are in use, and the connection reuse and prefetch in effect.
:mod:`tests.peer.run` refuses a pooled run whose worker did not run the way a user's does.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from celery import Celery, signals

POOLED = os.environ.get("POOLS_PEER_MODE", "plain") != "plain"
if POOLED:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.peer.settings")
else:
    os.environ.pop("DJANGO_SETTINGS_MODULE", None)

app = Celery("peer", set_as_current=True)
app.config_from_object(
    "django.conf:settings" if POOLED else "tests.peer.settings", namespace="CELERY"
)
if POOLED:
    app.autodiscover_tasks()


def _register_class_tasks() -> None:
    from t.integration.tasks import ClassBasedAutoRetryTask

    app.register_task(ClassBasedAutoRetryTask)


_register_class_tasks()

_checked: list[int] = []
logger = logging.getLogger("tests.peer")


@signals.task_prerun.connect(weak=False)
def _peer_check(**kwargs: Any) -> None:
    """Once per worker process: say how this process reaches the pools' database."""
    if _checked == [os.getpid()]:
        return
    _checked[:] = [os.getpid()]
    fields = {
        "mode": os.environ.get("POOLS_PEER_MODE", "plain"),
        "prefetch": app.conf.worker_prefetch_multiplier,
        "db_reuse_max": app.conf.get("db_reuse_max"),
    }
    if POOLED:
        from pools.pg import fastpath

        fields["fast_path"] = "on" if fastpath.enabled() else "off"
        fields["own_connection"] = "on" if fastpath._Own.enabled else "off"
    logger.warning(
        "peer-check pid=%s %s", os.getpid(), " ".join(f"{k}={v}" for k, v in fields.items())
    )
