"""A session cut off by a silent partition in the middle of a pools transaction.

A second session, through a black-holing proxy (:mod:`tests.support.blackhole`), opens a
transaction as pools does (the same ``SET LOCAL`` bound, :func:`pools.core.locking.bound_sql`)
and locks a pool's row; then its traffic is black-holed: no RST, no FIN. The server cannot
tell a silent client from a slow one; what ends the session is
``idle_in_transaction_session_timeout``, one ``LOCK_TIMEOUT_SECONDS`` (the proxy's kernel
still acknowledges, so TCP-level bounds do not fire through it). The pool goes on after
about that long. The sabotage twin switches the idle bound off and the lock stays held.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from django.db import DatabaseError, connection
from pytest_django import Settings

from pools.core import locking
from pools.exceptions import PoolUnavailable
from tests.conftest import POOL_APPS
from tests.support.blackhole import BlackholeProxy
from tests.support.factories import make_pool

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True, available_apps=POOL_APPS),
]

BOUND = 1.0


@contextmanager
def cut_off_holder(pool: str, *, idle_bound: bool = True) -> Iterator[tuple[BlackholeProxy, int]]:
    """A session through a proxy that holds ``pool``'s row lock in a pools-bounded
    transaction, then goes silent; yields the proxy and the session's server pid."""
    db = connection.settings_dict
    with BlackholeProxy(db["HOST"] or "127.0.0.1", int(db["PORT"] or 5432)) as proxy:
        conn: psycopg.Connection[Any] = psycopg.connect(
            host="127.0.0.1",
            port=proxy.port,
            user=db["USER"],
            dbname=db["NAME"],
            cursor_factory=psycopg.ClientCursor,
        )
        try:
            pid = conn.info.backend_pid
            conn.execute(*locking.bound_sql(idle=True))  # opens the transaction
            if not idle_bound:
                conn.execute("SET LOCAL idle_in_transaction_session_timeout = 0")
            conn.execute("SELECT 1 FROM pools_pool WHERE name = %s FOR UPDATE", [pool])
            proxy.cut()
            yield proxy, pid
        finally:
            proxy.close()
            conn.close()


def session_alive(pid: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid])
        return cursor.fetchone() is not None


def test_partition__cut_off_lock_holder_loses_its_session_after_the_lock_bound(
    settings: Settings,
) -> None:
    settings.POOLS = {**settings.POOLS, "LOCK_TIMEOUT_SECONDS": BOUND}
    make_pool("p", 1)
    with cut_off_holder("p") as (_, pid):
        cut = time.monotonic()
        with connection.cursor() as cursor, pytest.raises(DatabaseError):  # held after the cut
            cursor.execute("SELECT 1 FROM pools_pool WHERE name = 'p' FOR UPDATE NOWAIT")
        refused = 0
        deadline = cut + 60
        while True:
            try:
                with locking.locked_pools(["p"]):
                    break
            except PoolUnavailable:
                refused += 1
                assert time.monotonic() < deadline, "the cut-off session kept the lock"
        stall = time.monotonic() - cut
        print(f"\npool lock free {stall:.2f}s after the cut (bound {BOUND:g}s, {refused} refusals)")
        assert not session_alive(pid)


def test_partition__sabotage_without_the_idle_bound_the_lock_stays_held(
    settings: Settings,
) -> None:
    settings.POOLS = {**settings.POOLS, "LOCK_TIMEOUT_SECONDS": BOUND}
    make_pool("p", 1)
    with cut_off_holder("p", idle_bound=False) as (_, pid):
        time.sleep(4 * BOUND)
        with pytest.raises(PoolUnavailable):
            with locking.locked_pools(["p"]):
                pass
        assert session_alive(pid)
