"""Real ``celery worker`` prefork subprocesses on a real broker, against the test database.

The ``celery_workers`` fixture is a factory: ``celery_workers(count=2, concurrency=4)``
starts that many workers and returns their handles once each answers a ping. Every
worker reads the database the test is using (``POOLS_PG_NAME`` / ``POOLS_MYSQL_NAME`` is
the test database's name) and the broker/result backend of the test process. The broker's Redis database
is flushed before the first worker starts, so messages left by an earlier run cannot
leak in. On teardown each worker gets SIGTERM (warm shutdown), then its whole process
group SIGKILL after a timeout: no worker outlives its test. A line logged at ERROR or
CRITICAL by a worker during the test fails it; worker logs are attached to the report
of a failed test.
"""

from __future__ import annotations

import itertools
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import pytest
from django.conf import settings
from django.db import connection

from pools.celery import processes
from pools.celery.processes import Process
from tests.conftest import IN_CI

ROOT = Path(__file__).resolve().parents[2]
#: How long a worker may take to answer its first ping.
START_TIMEOUT = 60.0
#: How long a warm shutdown may take before the process group is killed.
STOP_TIMEOUT = 15.0
#: Lines of each worker log shown for a failed test.
LOG_TAIL = 300

#: A worker log line at ERROR or CRITICAL level (e.g. a settle that raised).
ERROR_LINE = re.compile(r"^\[[^\]]*: (ERROR|CRITICAL)/")

#: ``pytestmark`` of the test modules that start workers: a real database server
#: (PostgreSQL or MariaDB/MySQL) and Redis, and transactional tests, so that the worker
#: processes see what the test wrote.
WORKER_TEST_MARKS = [
    pytest.mark.server_db,
    pytest.mark.redis,
    pytest.mark.acceptance,
    pytest.mark.django_db(transaction=True),
]

_LOGS = pytest.StashKey[list[Path]]()
_names = itertools.count(1)


#: One ``celery worker`` subprocess: node name, ``proc``, ``log``, ``log_text()``, ``alive()``.
Worker = Process


class StartWorkers(Protocol):
    """The ``celery_workers`` fixture: start workers, return them once they answer a ping."""

    def __call__(
        self,
        count: int = 2,
        concurrency: int = 4,
        pool: str = "prefork",
        allow_errors: bool = False,
        extra_args: Sequence[str] = (),
    ) -> list[Worker]: ...


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def _need_url(url: str, what: str, schemes: tuple[str, ...]) -> None:
    if url.startswith(schemes):
        return
    message = (
        f"acceptance tests need a real {what} ({' or '.join(schemes)}; set "
        f"{what.upper()}), got {url!r}"
    )
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


def _flush_broker(url: str) -> None:
    """Drop messages an earlier run left behind: the Redis database, or RabbitMQ's queues."""
    if url.startswith("redis://"):
        import redis

        client = redis.Redis.from_url(url)
        try:
            client.flushdb()
        finally:
            client.close()
        return
    from tests.celery_app import app

    app.control.purge()


def _worker_env() -> dict[str, str]:
    db = connection.settings_dict
    if connection.vendor not in {"postgresql", "mysql"}:
        pytest.fail("acceptance workers need a database server (POOLS_TEST_DB=postgres or mysql)")
    env = dict(os.environ)
    env.update(
        {
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
            "POOLS_TEST_DB": "postgres" if connection.vendor == "postgresql" else "mysql",
            # The database the test is using right now (pytest-django's test database).
            "POOLS_PG_NAME": db["NAME"],
            "POOLS_MYSQL_NAME": db["NAME"],
            "CELERY_BROKER_URL": settings.CELERY_BROKER_URL,
            "CELERY_RESULT_BACKEND": settings.CELERY_RESULT_BACKEND,
        }
    )
    return env


def start_celery(
    request: pytest.FixtureRequest, args: list[str], *, cwd: Path, log: Path, name: str
) -> Process:
    """``python -m celery -A tests <args>`` in a session of its own, on the test database.

    Its output goes to ``log``, which is attached to the report if the test fails. Stop it
    with :func:`pools.celery.processes.stop`.
    """
    started = processes.start_celery("tests", args, log=log, name=name, env=_worker_env(), cwd=cwd)
    request.node.stash.setdefault(_LOGS, []).append(log)
    return started


@pytest.fixture
def celery_workers(
    request: pytest.FixtureRequest, tmp_path: Path, transactional_db: None
) -> Iterator[StartWorkers]:
    """Factory: ``celery_workers(count=2, concurrency=4)`` -> ready :class:`Worker` handles.

    ``pool`` picks the execution pool (``"prefork"`` by default, or ``"threads"``/``"solo"``).
    ``allow_errors=True`` exempts these workers from the "no ERROR lines" teardown check,
    for tests that inject faults the workers are expected to log.
    """
    from pools.core import settings_sync
    from tests.celery_app import app

    broker = settings.CELERY_BROKER_URL
    backend = settings.CELERY_RESULT_BACKEND
    _need_url(broker, "celery_broker_url", ("redis://", "amqp://"))
    _need_url(backend, "celery_result_backend", ("redis://",))
    started: list[Worker] = []
    #: Workers whose errors are expected by the test (fault injection).
    errors_allowed: set[str] = set()
    request.node.stash[_LOGS] = []
    flushed = False

    def start(
        count: int = 2,
        concurrency: int = 4,
        pool: str = "prefork",
        allow_errors: bool = False,
        extra_args: Sequence[str] = (),
    ) -> list[Worker]:
        nonlocal flushed
        if not flushed:
            _flush_broker(broker)
            flushed = True
            # A transactional test with ``available_apps`` flushes without migrate's
            # post_migrate sync, so settings-defined pools may be gone: sync as migrate does.
            settings_sync.sync()
        new: list[Worker] = []
        for _ in range(count):
            node = f"accept{next(_names)}-{uuid.uuid4().hex[:6]}"
            log = tmp_path / f"{node}.log"
            process = processes.start_worker(
                "tests",
                node=node,
                log=log,
                concurrency=concurrency,
                pool=pool,
                extra_args=extra_args,
                env=_worker_env(),
                cwd=ROOT,
            )
            request.node.stash.setdefault(_LOGS, []).append(log)
            if allow_errors:
                errors_allowed.add(process.name)
            started.append(process)
            new.append(process)
        try:
            # Ready: the worker logged "ready." and answers a ping over the test broker.
            processes.wait_ready(new, timeout=START_TIMEOUT, ping=app)
        except processes.ProcessStartError as exc:
            pytest.fail(f"worker did not start: {exc}")
        return new

    yield start

    # Errors the workers logged while the test ran (before shutdown noise) fail the test:
    # the gate logs and swallows some failures (settle, publish) that a result cannot show.
    errors = [
        f"{w.name}: {line}"
        for w in started
        if w.name not in errors_allowed
        for line in w.log_text().splitlines()
        if ERROR_LINE.match(line)
    ]
    processes.stop(started, STOP_TIMEOUT)
    leftovers = [w.name for w in started if w.proc.returncode is None]
    assert not leftovers, f"workers still running after teardown: {leftovers}"
    if errors:
        pytest.fail("workers logged errors during the test:\n" + "\n".join(errors[:50]))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    logs = item.stash.get(_LOGS, [])
    if report.failed and logs:
        for log in logs:
            try:
                lines = log.read_text(errors="replace").splitlines()
            except OSError as exc:
                lines = [f"<cannot read {log}: {exc}>"]
            report.sections.append(
                (f"worker log {log.name} (last {LOG_TAIL} lines)", "\n".join(lines[-LOG_TAIL:]))
            )
    return report
