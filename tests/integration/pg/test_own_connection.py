"""Pools' own connection (workers): start and settle run on a connection Celery's Django
fixup does not close, as server-side prepared statements, with the bound set per session.

PostgreSQL only (the fast path). The test processes' Django connection is closed before
each call, as Celery's fixup closes it around every task without ``CELERY_DB_REUSE_MAX``:
start and settle must not reopen it.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection

from pools import signals
from pools.core import admission, leases
from pools.exceptions import PoolUnavailable
from pools.models import Pool, PoolEvent, QueueEntry
from pools.pg import fastpath, functions
from pools.states import EntryState
from tests.conftest import POOL_APPS
from tests.support.factories import make_pool, submit

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True, available_apps=POOL_APPS),
]


def _own_prepared() -> list[str]:
    cur = fastpath._connect().execute("SELECT statement FROM pg_prepared_statements")
    return [row[0] for row in cur.fetchall()]


def test_own_connection__start_and_settle_leave_djangos_connection_closed(recorder, own):
    heard: list[str] = []

    def receive(sender: Any, event: PoolEvent, **kwargs: Any) -> None:
        heard.append(f"{event.kind}:{event.key}")

    for signal in signals.BY_KIND.values():
        signal.connect(receive, sender=PoolEvent, weak=False)
    try:
        make_pool("p", 1)
        assert submit("p", key="a").admitted
        submit("p", key="b")
        first = recorder.admissions[0]
        for _ in range(3):
            connection.close()  # what Celery's fixup does around each task
            assert leases.start(first.entry_id, first.token, worker="w") is not None
            assert connection.connection is None, "start reopened Django's connection"
            connection.close()
            assert admission.settle(first.entry_id, first.token, "succeeded", live_lease=True)
            assert connection.connection is None, "settle reopened Django's connection"
            # settle admitted the next entry and published it at once (committed).
            first = recorder.admissions[-1]
            submit("p", key=f"again-{_}")
    finally:
        for signal in signals.BY_KIND.values():
            signal.disconnect(receive, sender=PoolEvent)
    assert recorder.keys()[:2] == ["a", "b"]
    assert "started:a" in heard and "settled:a" in heard and "admitted:b" in heard
    assert QueueEntry.objects.get(key="a").state == EntryState.SUCCEEDED
    assert Pool.objects.get(name="p").held == 1
    # The calls ran as server-side prepared statements on the own connection.
    prepared = " ".join(_own_prepared())
    assert functions.name("start") in prepared and functions.name("settle_call") in prepared


def test_own_connection__inside_djangos_transaction_the_call_joins_it(recorder, own):
    from django.db import transaction

    make_pool("p", 1)
    with transaction.atomic():
        assert not submit("p", key="a").admitted, "admitted after the caller commits"
        assert QueueEntry.objects.filter(key="a").exists()
        assert recorder.keys() == [], "published only when the caller commits"
    assert recorder.keys() == ["a"]


def test_own_connection__lock_timeout_is_pool_unavailable_and_changes_nothing(
    recorder, own, settings
):

    settings.POOLS = {**settings.POOLS, "LOCK_TIMEOUT_SECONDS": 0.3}
    adm = _settle_times_out_behind_a_pool_lock(recorder)
    assert admission.settle(adm.entry_id, adm.token, "succeeded", live_lease=True)


def test_own_connection__one_per_thread(recorder, own):
    pids: list[int] = []

    def work() -> None:
        pids.append(fastpath.own_backend_pid())
        fastpath.close_own_connection()

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(pids)) == 2
    assert fastpath.own_backend_pid() not in pids


def test_own_connection__a_forked_child_opens_its_own(recorder, own):
    import os

    parent = fastpath.own_backend_pid()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a connection of its own, never the parent's
        try:
            os.write(write, str(fastpath.own_backend_pid()).encode())
        finally:
            os._exit(0)
    os.close(write)
    child = int(os.read(read, 32) or b"0")
    os.waitpid(pid, 0)
    os.close(read)
    assert child and child != parent
    # The parent's session is intact (closed before the fork, reopened on use).
    make_pool("p", 1)
    assert submit("p", key="after-fork").admitted
    adm = recorder.admissions[0]
    assert leases.start(adm.entry_id, adm.token, worker="w") is not None


def test_own_connection__bounds_its_socket_on_the_client(own: None, settings: Any) -> None:
    """Connect timeout, keepalives and tcp_user_timeout (a hung socket fails in a bound)."""
    settings.POOLS = {**settings.POOLS, "LOCK_TIMEOUT_SECONDS": 2.5}
    fastpath.close_own_connection()
    params = fastpath._connect().info.get_parameters()
    assert params["connect_timeout"] == "3"
    assert params["tcp_user_timeout"] == "2500"
    assert (params["keepalives"], params["keepalives_idle"]) == ("1", "3")


def test_client_bounds__never_override_the_users_options() -> None:
    from pools.core.locking import bound_client_options

    mine = bound_client_options({"connect_timeout": 30, "keepalives": 0, "sslmode": "require"})
    assert (mine["connect_timeout"], mine["keepalives"], mine["sslmode"]) == (30, 0, "require")
    assert "tcp_user_timeout" in mine and "keepalives_idle" in mine


def test_worker_process_init__bounds_djangos_connections_too(settings: Any) -> None:
    from django.db import connections

    from pools.celery import worker

    saved = dict(connections.settings["default"].get("OPTIONS") or {})
    try:
        connections.settings["default"]["OPTIONS"] = {**saved, "connect_timeout": 17}
        worker._bound_database_sockets()
        options = connections.settings["default"]["OPTIONS"]
        assert options["connect_timeout"] == 17  # the user's own value stays
        assert "tcp_user_timeout" in options and options["keepalives"] == 1
        connection.close()
        with connection.cursor() as cursor:  # Django connects with them
            cursor.execute("SELECT 1")
        assert connection.connection.info.get_parameters()["connect_timeout"] == "17"
    finally:
        connections.settings["default"]["OPTIONS"] = saved
        connection.close()


def _session_statement_timeout() -> str:
    """``statement_timeout`` of the own connection's session, outside any transaction."""
    return str(fastpath._connect().execute("SHOW statement_timeout").fetchone()[0])


@pytest.mark.parametrize("prepared", [True, False])
def test_own_connection__prepared_statements_off_leaves_no_session_state(
    recorder, own, settings, prepared
):
    """Off (``prepare_threshold=None`` in OPTIONS, or ``POOLS["PREPARED_STATEMENTS"]``):
    nothing prepared and no session ``SET`` on the own connection, so a transaction
    pooler can hand its server connection to anyone between calls. The ``prepared`` twin
    shows both checks can fail."""
    settings.POOLS = {**settings.POOLS, "PREPARED_STATEMENTS": prepared}
    fastpath.close_own_connection()
    make_pool("p", 1)
    assert submit("p", key="a").admitted
    adm = recorder.admissions[0]
    assert leases.start(adm.entry_id, adm.token, worker="w") is not None
    assert admission.settle(adm.entry_id, adm.token, "succeeded", live_lease=True)
    prepared_now = " ".join(_own_prepared())
    timeout = _session_statement_timeout()
    if prepared:
        assert functions.name("start") in prepared_now
        assert functions.name("settle_call") in prepared_now
        assert timeout == "5s"
    else:
        assert prepared_now == ""
        assert timeout == "0"
    assert QueueEntry.objects.get(key="a").state == EntryState.SUCCEEDED


def test_own_connection__prepared_statements_off_still_bounds_each_call(recorder, own, settings):
    """The bound goes with each call (``SET LOCAL`` in its query string): a lock wait past
    it is ``PoolUnavailable`` and changes nothing, as with the session setting."""

    settings.POOLS = {
        **settings.POOLS,
        "LOCK_TIMEOUT_SECONDS": 0.3,
        "PREPARED_STATEMENTS": False,
    }
    fastpath.close_own_connection()
    adm = _settle_times_out_behind_a_pool_lock(recorder)
    assert _session_statement_timeout() == "0"
    assert admission.settle(adm.entry_id, adm.token, "succeeded", live_lease=True)


@pytest.mark.parametrize("prepared", [True, False])
def test_own_connection__statement_bound_holds_with_prepared_statements_on_and_off(
    own, settings, prepared
):
    """``statement_timeout`` (which a function cannot set for its own statement) bounds a
    call either way: the session setting, or ``SET LOCAL`` sent with the call."""
    settings.POOLS = {
        **settings.POOLS,
        "LOCK_TIMEOUT_SECONDS": 0.2,
        "PREPARED_STATEMENTS": prepared,
    }
    fastpath.close_own_connection()
    with pytest.raises(PoolUnavailable, match="statement timeout"):
        fastpath._execute_own("SELECT * FROM pg_sleep(%s)", [2], "a slow call")


def _settle_times_out_behind_a_pool_lock(recorder: Any) -> Any:
    """A running entry whose settle meets the pool row locked by another connection:
    PoolUnavailable, and the entry still running. Returns its admission."""
    import psycopg

    make_pool("p", 1)
    make_pool("q", 1)
    # Two pools: the settle of a one-pool entry would not wait for the lock (it leaves its
    # release to the holder: tests/integration/pg/test_owed_work.py).
    assert submit({"p": 1, "q": 1}, key="a").admitted
    adm = recorder.admissions[0]
    assert leases.start(adm.entry_id, adm.token, worker="w") is not None
    params = {
        k: v
        for k, v in connection.get_connection_params().items()
        if k not in {"cursor_factory", "context", "prepare_threshold"}
    }
    locker = psycopg.connect(**params)
    try:
        locker.execute("SELECT 1 FROM pools_pool WHERE name = 'p' FOR UPDATE")
        with pytest.raises(PoolUnavailable, match=r"lock timeout|statement timeout"):
            admission.settle(adm.entry_id, adm.token, "succeeded", live_lease=True)
    finally:
        locker.rollback()
        locker.close()
    assert QueueEntry.objects.get(key="a").state == EntryState.RUNNING
    return adm
