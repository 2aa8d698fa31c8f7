"""Appended to the extracted ``t/integration/conftest.py``: an external worker, pools set up.

The suite's ``celery_session_worker`` starts an in-process worker; here the worker is
the external prefork process :mod:`tests.peer.run` started, and the fixture only
registers the suite's tasks on the session app as the original does. In a pooled run
Django is set up first, which installs the pools gate in this (the calling) process.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

POOLED = os.environ.get("POOLS_PEER_MODE", "plain") != "plain"
_kept: list[Any] = []

if POOLED:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.peer.settings")
    import django

    django.setup()

    def _forget_connections_after_fork() -> None:
        """A forked child (the suite forks producers) must not use the parent's socket.

        Closing would end the parent's session too: keep the objects, drop the handles.
        """
        from django.db import connections

        for conn in connections.all(initialized_only=True):
            _kept.append(conn.connection)
            conn.connection = None

    os.register_at_fork(after_in_child=_forget_connections_after_fork)


@pytest.fixture(scope="session")
def celery_session_worker(
    celery_session_app: Any, celery_includes: Any, celery_class_tasks: Any
) -> Iterator[None]:
    for module in celery_includes:
        celery_session_app.loader.import_task_module(module)
    for class_task in celery_class_tasks:
        celery_session_app.register_task(class_task)
    yield None
