"""A long-lived caller (beat, a script) recovers from a database restart by itself."""

from __future__ import annotations

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


def test_pooled_call_after_the_connection_died__fails_once_then_reconnects():
    _kill_our_backend()
    with pytest.raises(PoolUnavailable):
        record.apply_async(args=[1])
    result = record.apply_async(args=[2])
    assert QueueEntry.objects.filter(key=result.id).exists()
