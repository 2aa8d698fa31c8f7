"""The engine choice on PostgreSQL without this release's stored functions.

Code deployed before ``manage.py migrate pools`` finds the database without the functions
it calls (``pools.pg.functions.VERSION``). The engine choice then gives the connection the
ORM engine (correct, slower) instead of the PostgreSQL engine, whose calls would all fail,
and a warning says once how to fix it. Here one function is renamed away in the test
database and renamed back afterwards.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from django.db import connection
from django.utils import timezone

from pools.core import engine as engine_module
from pools.core.engines.orm import ORM
from pools.core.records import Submission
from pools.exceptions import PoolUnavailable
from pools.models import QueueEntry
from pools.pg import engine as pg_engine
from pools.pg import functions
from pools.specs import PoolSpec
from pools.states import EntryState
from tests.conftest import POOL_APPS
from tests.support.factories import make_pool, submit

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True, available_apps=POOL_APPS),
]

ENQUEUE = functions.name("enqueue")
HIDDEN = f"{ENQUEUE}_hidden"


def forget_choice() -> None:
    """As a new process: nothing chosen or read yet."""
    engine_module._installed.clear()
    for kept in ("_pools_engine", "_pools_missing_functions"):
        if hasattr(connection, kept):
            delattr(connection, kept)


def rename(old: str, new: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER FUNCTION {old} RENAME TO {new}")


def count_reads(monkeypatch) -> list[list[str]]:
    """What each catalog read of the engine choice found, in order."""
    reads: list[list[str]] = []
    real = pg_engine.missing_functions

    def counted() -> list[str]:
        reads.append(real())
        return reads[-1]

    monkeypatch.setattr(pg_engine, "missing_functions", counted)
    return reads


@pytest.fixture
def fast_path(settings, monkeypatch) -> Iterator[None]:
    settings.POOLS = {**settings.POOLS, "SQL_FAST_PATH": True}
    monkeypatch.setattr(engine_module, "_installed", set())  # the process's, put back after
    forget_choice()
    yield
    forget_choice()


@pytest.fixture
def without_enqueue_function(fast_path: None, monkeypatch) -> Iterator[None]:
    monkeypatch.setattr(engine_module, "_warned", set())
    rename(ENQUEUE, HIDDEN)
    try:
        yield
    finally:
        rename(HIDDEN, ENQUEUE)
        forget_choice()


def test_engine_choice__with_the_functions_installed_postgresql_gets_its_engine(
    fast_path, monkeypatch
):
    reads = count_reads(monkeypatch)
    assert engine_module.engine() is pg_engine.POSTGRESQL
    connection.close()
    delattr(connection, "_pools_engine")  # a new connection of the same process
    assert engine_module.engine() is pg_engine.POSTGRESQL
    assert reads == [[]]  # installed: read once per process


def test_engine_choice__without_a_function_the_orm_engine_admits_and_one_warning_says_migrate(
    recorder, without_enqueue_function, caplog, monkeypatch
):
    make_pool("p", 1)
    # The situation is real: the PostgreSQL engine itself fails on this database.
    sub = Submission(key="direct", task_name="t", spec=PoolSpec(demand={"p": 1}))
    with pytest.raises(PoolUnavailable):
        pg_engine.POSTGRESQL.enqueue(sub, timezone.now(), None, budgeted=False)
    assert pg_engine.missing_functions() == [ENQUEUE]

    reads = count_reads(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="pools.engine"):
        assert engine_module.engine() is ORM
        assert submit("p", key="a").admitted
        assert not submit("p", key="b").admitted  # waits: one slot
        assert engine_module.engine() is ORM
        connection.close()  # a new session: read again, no second warning
        assert engine_module.engine() is ORM
    assert reads == [[ENQUEUE], [ENQUEUE]]  # once per session, not per call
    warnings = [r.getMessage() for r in caplog.records if r.name == "pools.engine"]
    assert len(warnings) == 1, warnings
    assert ENQUEUE in warnings[0] and "manage.py migrate pools" in warnings[0]
    states = dict(QueueEntry.objects.values_list("key", "state"))
    assert states == {"a": EntryState.ADMITTED, "b": EntryState.WAITING}


def test_engine_choice__a_new_session_after_migrate_gets_the_postgresql_engine_back(
    recorder, without_enqueue_function
):
    assert engine_module.engine() is ORM
    rename(HIDDEN, ENQUEUE)  # what migrate does
    try:
        assert engine_module.engine() is ORM  # same session: kept
        connection.close()
        assert engine_module.engine() is pg_engine.POSTGRESQL  # new session: chosen again
    finally:
        rename(ENQUEUE, HIDDEN)  # the fixture renames it back
