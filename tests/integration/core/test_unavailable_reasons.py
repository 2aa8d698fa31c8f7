"""``PoolUnavailable`` says in one line what happened and what to do, on every database.

The driver's own text can span lines (PostgreSQL adds ``LINE 2: ... ^``, ``QUERY:`` and
``CONTEXT:`` lines; a MySQL message may hold a newline): the refusal a user sees keeps
its first line and the advice, the full text goes to the ``pools.locking`` log and stays
reachable as ``__cause__``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from django.db import connection
from pytest_django import Settings

from pools.core import locking
from pools.exceptions import PoolUnavailable
from pools.models import QueueEntry
from tests.conftest import POOL_APPS
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = [
    pytest.mark.server_db,
    pytest.mark.django_db(transaction=True, available_apps=POOL_APPS),
]

#: A statement whose error text spans lines, per server.
MULTI_LINE_ERROR = {
    # invalid input syntax ... \nLINE 2:  + 'x'::int\n           ^
    "postgresql": "SELECT 1\n + 'x'::int",
    "mysql": "SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'pool row is gone\\nsecond line'",
}


def test_unavailable_on_error__a_multi_line_driver_error_becomes_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="pools.locking"):
        with pytest.raises(PoolUnavailable) as caught, locking.unavailable_on_error("probing"):
            with connection.cursor() as cursor:
                cursor.execute(MULTI_LINE_ERROR[connection.vendor])
    driver_text = str(caught.value.__cause__)
    message = str(caught.value)
    assert "\n" in driver_text or "\\n" in driver_text, driver_text  # it really was several
    assert "\n" not in message, message
    assert message.startswith("pool state is unavailable (probing): ")
    assert "LINE 2" not in message and "^" not in message and "second line" not in message
    assert message.endswith("see the pools.locking log for the database's detail")
    # The detail is in the log, whole.
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "LINE 2" in logged or "second line" in logged, logged


@pytest.mark.postgres
def test_lock_timeout__postgres_reason_is_one_line_on_both_paths(
    recorder: RecordingBridge, settings: Settings, admission_path: str
) -> None:
    from tests.integration.core.test_locking import pool_row_locked

    settings.POOLS = {**settings.POOLS, "LOCK_TIMEOUT_SECONDS": 0.5}
    make_pool("p", 1)
    with pool_row_locked("p"), pytest.raises(PoolUnavailable) as caught:
        submit("p", key="timed-out")
    message = str(caught.value)
    assert "\n" not in message, message
    assert "canceling statement due to" in message
    # "held a pool row past" (lock_timeout) or "passed" (statement_timeout): whichever
    # the server reported first (a procedure's CALL has only the lock bound).
    assert "LOCK_TIMEOUT_SECONDS (0.5s); retry" in message, message
    # PostgreSQL's own text had more (CONTEXT: ... lines): kept as the cause.
    assert "CONTEXT" in str(caught.value.__cause__), str(caught.value.__cause__)
    assert not QueueEntry.objects.exists()


@pytest.mark.mysql
def test_connection_lost__reason_says_to_check_the_server(
    recorder: RecordingBridge, settings: Settings
) -> None:
    """The server ends the session (``KILL``): the next operation says what to check."""
    make_pool("p", 1)
    with connection.cursor() as cursor:
        cursor.execute("SELECT CONNECTION_ID()")
        (session,) = cursor.fetchone()
    from tests.integration.core.test_locking_mysql import raw_connection

    killer: Any = raw_connection()
    try:
        killer.cursor().execute(f"KILL {int(session)}")
    finally:
        killer.close()
    time.sleep(0.2)
    with pytest.raises(PoolUnavailable) as caught:
        submit("p", key="lost")
    message = str(caught.value)
    assert "\n" not in message
    assert "check that the database server is up" in message, message
    connection.close()
    assert submit("p", key="after").admitted
