"""System checks for MariaDB/MySQL (``pools.E020``, ``pools.W020``), and why READ COMMITTED.

The isolation check is not a matter of taste: the last test shows REPEATABLE READ
oversubscribing a pool when an enqueue runs inside a transaction that has already read.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from django.core import checks
from django.db import connection, transaction

from pools import checks as pool_checks
from pools.models import QueueEntry
from tests.conftest import POOL_APPS
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = [
    pytest.mark.mysql,
    pytest.mark.django_db(transaction=True, available_apps=POOL_APPS),
]


def ids(messages: list[checks.CheckMessage]) -> list[str]:
    return [str(m.id) for m in messages]


@pytest.fixture
def repeatable_read() -> Iterator[None]:
    """Django's session at REPEATABLE READ for the test (the server's own default)."""
    with connection.cursor() as cur:
        cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    yield
    with connection.cursor() as cur:
        cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")


def test_checks__the_test_settings_pass() -> None:
    assert pool_checks.check_mysql_settings() == []
    assert pool_checks.check_mysql_database(databases=["default"]) == []
    # A database check: without databases (plain `manage.py check`) it does not query.
    assert pool_checks.check_mysql_database(databases=None) == []
    registered = checks.registry.registry.get_checks()
    assert pool_checks.check_mysql_settings in registered
    assert pool_checks.check_mysql_database in registered
    assert checks.Tags.database in pool_checks.check_mysql_database.tags


def test_checks__repeatable_read_in_options_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    options = {**connection.settings_dict["OPTIONS"], "isolation_level": "repeatable read"}
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)
    (message,) = pool_checks.check_mysql_settings()
    assert message.id == "pools.W020"
    assert "REPEATABLE READ" in message.msg
    assert message.hint and "'read committed'" in message.hint


def test_checks__repeatable_read_in_the_session_is_reported(repeatable_read: None) -> None:
    (message,) = pool_checks.check_mysql_database(databases=["default"])
    assert message.id == "pools.W020"
    assert "session runs at REPEATABLE READ" in message.msg


def test_checks__a_table_that_is_not_innodb_is_an_error() -> None:
    with connection.cursor() as cur:
        cur.execute("ALTER TABLE pools_workernode ENGINE=MyISAM")
    try:
        (message,) = pool_checks.check_mysql_database(databases=["default"])
    finally:
        with connection.cursor() as cur:
            cur.execute("ALTER TABLE pools_workernode ENGINE=InnoDB")
    assert message.id == "pools.E020"
    assert "pools_workernode (MyISAM)" in message.msg
    assert pool_checks.check_mysql_database(databases=["default"]) == []


def _admit_elsewhere(key: str) -> None:
    """Enqueue from another connection (its own thread), committed when it returns."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            assert submit("p", key=key).admitted
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert not errors, errors


@pytest.mark.parametrize("level", ["READ COMMITTED", "REPEATABLE READ"])
def test_isolation__enqueue_after_a_read_in_the_same_transaction(
    recorder: RecordingBridge, level: str
) -> None:
    """A caller reads, another process takes the last slot, then the caller enqueues.

    The held slots are the pool row's ``held`` counter, read with the pool's row lock: a
    locking read sees the latest committed row under either level, so the entry waits.
    (Before the counter, the slots were summed from the caller's REPEATABLE READ snapshot,
    taken before the other admission committed, and a 1-slot pool admitted a second
    entry; pools.W020 still asks for READ COMMITTED for the line's plain reads.)
    """
    make_pool("p", 1)
    with connection.cursor() as cur:
        cur.execute(f"SET SESSION TRANSACTION ISOLATION LEVEL {level}")
    try:
        with transaction.atomic():
            assert QueueEntry.objects.count() == 0  # the caller's own read
            _admit_elsewhere("first")
            second = submit("p", key="second")
    finally:
        with connection.cursor() as cur:
            cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
    held = QueueEntry.objects.filter(state="admitted").count()
    assert second.admitted is False
    assert held == 1, "a 1-slot pool"
