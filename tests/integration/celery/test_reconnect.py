"""A long-lived caller (beat, a script) recovers from a database restart by itself."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from django.db import connection

from pools.exceptions import PoolUnavailable
from pools.models import QueueEntry
from tests.conftest import POOL_APPS
from tests.testapp.tasks import record

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True, available_apps=POOL_APPS),
]


def _kill_our_backend() -> None:
    """What a PostgreSQL restart does to this process's connection."""
    connection.ensure_connection()
    pid = connection.connection.info.backend_pid
    db = connection.settings_dict
    conninfo = f"host={db['HOST'] or '127.0.0.1'} port={db['PORT'] or 5432} user={db['USER']} dbname={db['NAME']}"
    with psycopg.connect(conninfo, autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [pid])


def test_pooled_call_after_the_connection_died__fails_once_then_reconnects() -> None:
    _kill_our_backend()
    with pytest.raises(PoolUnavailable):
        record.apply_async(args=(1,))
    result = record.apply_async(args=(2,))
    assert QueueEntry.objects.filter(key=result.id).exists()


def test_countdown_call_while_the_broker_is_down__is_kept_and_does_not_fail(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The timed wake-up of a delayed entry cannot be sent: the call still succeeds."""
    from kombu.exceptions import OperationalError

    from pools.celery import originals

    original = originals._original_send_task
    assert original is not None
    sent: list[str] = []

    def broker_down(app: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        sent.append(name)
        if name == "pools.admit":
            raise OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
        return original(app, name, *args, **kwargs)

    monkeypatch.setattr(originals, "_original_send_task", broker_down)
    result = record.apply_async(args=(3,), countdown=30)
    assert QueueEntry.objects.filter(key=result.id).exists()
    assert "pools.admit" in sent, "the call asked for a timed wake-up"
    assert "the next sweep admits them" in caplog.text


@pytest.mark.parametrize("task", ["sweep", "admit"])
def test_pools_tasks_after_the_connection_died__fail_once_then_reconnect(task: str) -> None:
    """A worker process keeps its connection between tasks (CELERY_DB_REUSE_MAX): after a
    PostgreSQL restart its sweeps failed on "the connection is closed" until the process
    was replaced (the chaos runner saw five minutes without a sweep)."""
    from django.db import OperationalError

    from pools.celery import tasks

    def run() -> object:
        return tasks.sweep() if task == "sweep" else tasks.admit(["warehouse"])

    _kill_our_backend()
    with pytest.raises(OperationalError):
        run()
    assert connection.errors_occurred
    run()  # reconnects instead of failing again
    run()
