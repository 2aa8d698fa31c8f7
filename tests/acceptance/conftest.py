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
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

import pytest
from django.conf import settings
from django.db import connection

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


@dataclass
class Worker:
    """One ``celery worker`` subprocess."""

    name: str  # node name, e.g. ``accept-1-ab12cd@myhost``
    proc: subprocess.Popen[bytes]
    log: Path
    #: Errors this worker logs are expected by the test (fault injection).
    allow_errors: bool = False
    _log_file: Any = field(repr=False, default=None)

    def log_text(self) -> str:
        return read_log(self.log)

    def alive(self) -> bool:
        return self.proc.poll() is None


def read_log(path: Path) -> str:
    """A subprocess log, or '' if it is not there (yet)."""
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


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


def _need_redis_url(url: str, what: str) -> None:
    if url.startswith("redis://"):
        return
    message = (
        f"acceptance tests need a Redis {what} (set {what.upper()} to redis://...), got {url!r}"
    )
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


def _flush_broker(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


def _worker_env() -> dict[str, str]:
    db = connection.settings_dict
    if connection.vendor not in {"postgresql", "mysql"}:
        pytest.fail(
            "acceptance workers need a database server (POOLS_TEST_DB=postgres or mysql)"
        )
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


def _ping(app: Any, name: str) -> bool:
    replies = app.control.ping(destination=[name], timeout=0.5)
    return any(name in reply for reply in replies or [])


def start_celery(
    request: pytest.FixtureRequest, args: list[str], *, cwd: Path, log: Path
) -> tuple[subprocess.Popen[bytes], IO[bytes]]:
    """``python -m celery -A tests <args>`` in a session of its own, on the test database.

    Its output goes to ``log``, which is attached to the report if the test fails.
    Returns the process and the open log file (closed by :func:`stop_processes`).
    """
    env = _worker_env()
    log_file = log.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tests", *args],
        cwd=cwd,
        env=env,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    request.node.stash.setdefault(_LOGS, []).append(log)
    return proc, log_file


class _Process(Protocol):
    """A handle :func:`start_celery` filled in (a :class:`Worker`, a beat)."""

    proc: subprocess.Popen[bytes]
    _log_file: Any


def stop_processes(started: Sequence[_Process], timeout: float) -> None:
    """Warm shutdown for all at once, then SIGKILL each process group (pool children too)."""
    for handle in started:
        if handle.proc.poll() is None:
            handle.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for handle in started:
        try:
            handle.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
    for handle in started:
        # Each process runs in its own session: kill whatever is left of its group.
        try:
            os.killpg(handle.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        handle.proc.wait(timeout=timeout)
        if handle._log_file is not None:
            handle._log_file.close()


@pytest.fixture
def celery_workers(
    request: pytest.FixtureRequest, tmp_path: Path, transactional_db: None
) -> Iterator[Callable[..., list[Worker]]]:
    """Factory: ``celery_workers(count=2, concurrency=4)`` -> ready :class:`Worker` handles.

    ``pool`` picks the execution pool (``"prefork"`` by default, or ``"threads"``/``"solo"``).
    ``allow_errors=True`` exempts these workers from the "no ERROR lines" teardown check,
    for tests that inject faults the workers are expected to log.
    """
    from pools.core import definitions
    from tests.celery_app import app

    broker = settings.CELERY_BROKER_URL
    backend = settings.CELERY_RESULT_BACKEND
    _need_redis_url(broker, "celery_broker_url")
    _need_redis_url(backend, "celery_result_backend")
    started: list[Worker] = []
    request.node.stash[_LOGS] = []
    flushed = False

    def start(
        count: int = 2, concurrency: int = 4, pool: str = "prefork", allow_errors: bool = False
    ) -> list[Worker]:
        nonlocal flushed
        if not flushed:
            _flush_broker(broker)
            flushed = True
            # A transactional test with ``available_apps`` flushes without migrate's
            # post_migrate sync, so settings-defined pools may be gone: sync as migrate does.
            definitions.sync()
        new: list[Worker] = []
        for _ in range(count):
            node = f"accept{next(_names)}-{uuid.uuid4().hex[:6]}"
            log = tmp_path / f"{node}.log"
            proc, log_file = start_celery(
                request,
                [
                    "worker",
                    "-P",
                    pool,
                    "-c",
                    str(concurrency),
                    "-n",
                    f"{node}@%h",
                    "--without-mingle",
                    "--without-gossip",
                    "-l",
                    "info",
                ],
                cwd=ROOT,
                log=log,
            )
            worker = Worker(
                name=f"{node}@{socket.gethostname()}",
                proc=proc,
                log=log,
                allow_errors=allow_errors,
                _log_file=log_file,
            )
            started.append(worker)
            new.append(worker)
        for worker in new:

            def ready(w: Worker = worker) -> bool:
                if not w.alive():
                    pytest.fail(
                        f"worker {w.name} exited with {w.proc.returncode} while starting:\n"
                        f"{w.log_text()[-5000:]}"
                    )
                return " ready." in w.log_text() and _ping(app, w.name)

            wait_for(ready, START_TIMEOUT, f"worker {worker.name} to answer a ping", 0.2)
        return new

    yield start

    # Errors the workers logged while the test ran (before shutdown noise) fail the test:
    # the gate logs and swallows some failures (settle, publish) that a result cannot show.
    errors = [
        f"{w.name}: {line}"
        for w in started
        if not w.allow_errors
        for line in w.log_text().splitlines()
        if ERROR_LINE.match(line)
    ]
    stop_processes(started, STOP_TIMEOUT)
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
