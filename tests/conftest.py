"""Shared fixtures. Services (PostgreSQL, MariaDB/MySQL, Redis): skipped locally when missing,
failed under CI.

Markers pick the database a test needs; a test whose database is not the one under test
is deselected (not skipped, not failed): ``postgres`` (PostgreSQL only: stored functions,
``pg_*`` views), ``mysql`` (MariaDB/MySQL only), ``server_db`` (a database server,
PostgreSQL or MariaDB/MySQL: real worker processes share it), ``pgbouncer`` (only through
the PgBouncer of ``make test-pgbouncer``).
"""

from __future__ import annotations

import gc
import os
import socket
from collections.abc import Iterator

import pytest
from django.conf import settings
from pytest_django import DjangoDbBlocker, Settings

from tests.support import pgbouncer
from tests.support.bridge import RecordingBridge

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def service_up(host: str, port: int) -> bool:
    """True if something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def require_service(name: str, host: str, port: int) -> None:
    """Skip (locally) or fail (CI=true) when a needed service is not reachable."""
    if service_up(host, port):
        return
    message = f"{name} is not reachable on {host}:{port}"
    if IN_CI:
        pytest.fail(f"{message} (CI=true: a missing service is a failure)")
    pytest.skip(message)


def require_previous_release() -> None:
    """Skip (locally) or fail (CI=true) when the previous release's commit
    (``tests.upgrade.run.PREVIOUS``) is not in this checkout's history (a shallow clone)."""
    from tests.upgrade import run

    if run.in_history(run.PREVIOUS):
        return
    message = f"the previous release {run.PREVIOUS} is not in this checkout's git history"
    if IN_CI:
        pytest.fail(f"{message} (CI=true: tests against the previous release must run)")
    pytest.skip(message + " (git fetch --unshallow)")


def db_vendor() -> str:
    """``postgresql``, ``mysql`` or ``sqlite``: the database the suite runs on."""
    return (
        str(settings.DATABASES["default"]["ENGINE"]).rsplit(".", 1)[-1].replace("sqlite3", "sqlite")
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "pgbouncer: runs only through PgBouncer (make test-pgbouncer; deselected otherwise)",
    )


def _runs_here(item: pytest.Item, vendor: str) -> bool:
    if item.get_closest_marker("pgbouncer") and not pgbouncer.ACTIVE:
        return False
    if item.get_closest_marker("postgres") and vendor != "postgresql":
        return False
    if item.get_closest_marker("mysql") and vendor != "mysql":
        return False
    return not (item.get_closest_marker("server_db") and vendor == "sqlite")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    vendor = db_vendor()
    deselected = [i for i in items if not _runs_here(i, vendor)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [i for i in items if i not in deselected]


@pytest.fixture(autouse=True, scope="session")
def _database_server() -> None:
    """The server of the database under test, checked before pytest-django creates the
    test database (otherwise a missing server is a connection error, not a skip)."""
    vendor = db_vendor()
    if vendor == "postgresql":
        require_service("PostgreSQL", "127.0.0.1", 5432)
        if pgbouncer.ACTIVE:  # make test-pgbouncer: the connections go through it
            require_service("PgBouncer", "127.0.0.1", pgbouncer.port())
    if vendor == "mysql":
        db = settings.DATABASES["default"]
        require_service("MariaDB/MySQL", str(db["HOST"]), int(str(db["PORT"])))


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup: None, django_db_blocker: DjangoDbBlocker) -> None:
    """pytest-django's test database, then, on PostgreSQL, the engine choice's one catalog
    read of the process (``pools.core.engine.missing_functions``: are the stored functions
    installed?). Read here, as a process that has served a call before has read it, so
    that a test counting the queries of one call counts that call's alone."""
    if db_vendor() == "postgresql":
        from pools.core import engine

        with django_db_blocker.unblock():
            engine.missing_functions()


@pytest.fixture(autouse=True)
def _services(request: pytest.FixtureRequest) -> None:
    vendor = db_vendor()
    if vendor == "postgresql":
        require_service("PostgreSQL", "127.0.0.1", 5432)
        if pgbouncer.ACTIVE:  # make test-pgbouncer: the connections go through it
            require_service("PgBouncer", "127.0.0.1", pgbouncer.port())
    if vendor == "mysql":
        db = settings.DATABASES["default"]
        require_service("MariaDB/MySQL", str(db["HOST"]), int(str(db["PORT"])))
    if request.node.get_closest_marker("redis"):
        require_service("Redis", "127.0.0.1", 6379)


@pytest.fixture
def recorder(settings: Settings) -> Iterator[RecordingBridge]:
    """Route admissions to an in-memory recorder instead of Celery."""
    from tests.support.bridge import recorder as rec

    pools = dict(settings.POOLS)
    pools["PUBLISHER"] = "tests.support.bridge.recorder"
    settings.POOLS = pools
    rec.reset()
    yield rec
    rec.reset()


@pytest.fixture(autouse=True)
def _no_collection_inside_redis_calls(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests that wait on Celery results in Redis: no cyclic garbage collection during the
    test, one after it. Celery 5.5.0 (``make test-lowest``) hangs for good when a
    collection lands inside a pub/sub call of its Redis result consumer and
    finalizes an old ``AsyncResult``, whose ``__del__`` re-enters that connection's lock
    (celery/celery#10477, fixed later by #10497): seen in ``test_gate_workers`` on
    2026-12-06.
    After the test the finalizers run outside any Redis call."""
    if not request.node.get_closest_marker("redis"):
        yield
        return
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        gc.collect()


@pytest.fixture(autouse=True)
def _forget_wake_ups() -> None:
    """Wake-ups remembered by this process (one timer per pool) belong to one test."""
    from pools.core import dispatch

    dispatch._scheduled.clear()


def _admission_paths() -> list[str]:
    return ["sql", "orm"] if os.environ.get("POOLS_TEST_DB") == "postgres" else ["orm"]


@pytest.fixture(params=_admission_paths())
def admission_path(request: pytest.FixtureRequest, settings: Settings) -> str:
    """Run a test on PostgreSQL's stored-function fast path and on the portable ORM path."""
    settings.POOLS = {**settings.POOLS, "SQL_FAST_PATH": request.param == "sql"}
    return str(request.param)


@pytest.fixture
def own(settings: Settings) -> Iterator[None]:
    """Calls outside a transaction run on pools' own connection, as in a worker process
    (PostgreSQL fast path)."""
    from pools.pg import fastpath

    settings.POOLS = {**settings.POOLS, "SQL_FAST_PATH": True}
    fastpath.use_own_connection()
    yield
    fastpath.use_own_connection(False)


#: Apps whose tables a transactional test flushes (much faster than flushing every app).
POOL_APPS = ["pools", "django_celery_beat", "tests.testapp"]


if pgbouncer.ACTIVE:
    # PgBouncer keeps server connections to the test database open after the suite closes
    # its own, and PostgreSQL refuses to drop a database in use: let go of them before
    # pytest-django creates the test database and before it drops it.

    @pytest.fixture(scope="session")
    def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix: None) -> None:
        pgbouncer.release(str(settings.DATABASES["default"]["TEST"]["NAME"]))

    @pytest.fixture(scope="session", autouse=True)
    def _pgbouncer_lets_go_of_the_test_database(django_db_setup: None) -> Iterator[None]:
        yield
        from django.db import connections

        connections.close_all()
        pgbouncer.release(str(settings.DATABASES["default"]["TEST"]["NAME"]))
