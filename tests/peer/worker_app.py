"""The Celery app of the external worker: Celery's integration configuration, plus pools.

``celery -A tests.peer.worker_app worker`` with ``POOLS_PEER_MODE=plain`` is a plain
Celery worker of ``t.integration.tasks``; with any other mode Django is set up with
:mod:`tests.peer.settings` first, so every task is gated by ``POOLS["TASKS"]``.
"""

from __future__ import annotations

import os

from celery import Celery

POOLED = os.environ.get("POOLS_PEER_MODE", "plain") != "plain"
if POOLED:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.peer.settings")
    import django

    django.setup()
else:
    os.environ.pop("DJANGO_SETTINGS_MODULE", None)

app = Celery("peer", set_as_current=True)
app.conf.update(
    broker_url=os.environ["TEST_BROKER"],
    result_backend=os.environ["TEST_BACKEND"],
    result_extended=True,
    task_create_missing_queues=False,
    worker_hijack_root_logger=False,
    include=["t.integration.tasks", *(["pools.celery.tasks"] if POOLED else [])],
)
if POOLED:
    app.conf.db_reuse_max = 1000


def _register_class_tasks() -> None:
    from t.integration.tasks import ClassBasedAutoRetryTask

    app.register_task(ClassBasedAutoRetryTask)


_register_class_tasks()
