"""Start, watch and stop ``celery worker`` (and ``celery beat``) subprocesses.

One helper for every place that runs real workers: the benchmark (``pools.bench.workers``),
the acceptance and browser tests (``tests/acceptance/conftest.py``) and the demo
(``example_project/run_demo.py``).

* :func:`start_worker` / :func:`start_celery` / :func:`start_process` start a child in a
  session of its own (a Ctrl-C in the terminal reaches only the parent, and the whole
  process group — the prefork pool included — can be killed at once), its stdout and
  stderr going to a log file.
* :func:`wait_ready` waits until each worker is ready: its log shows a readiness marker
  (``" ready."``, logged at INFO), it answers a ``ping`` over the broker, or both. A child
  that exits while starting raises :class:`ProcessStartError` quoting the end of its log.
* :func:`stop` sends SIGTERM to all (Celery's warm shutdown: running tasks finish), waits up
  to a timeout, then SIGKILLs whatever is left of each process group and reaps the child,
  so no pool process outlives it; :func:`kill` skips the warm part.

This module imports neither Django nor Celery at import time: the demo uses it before
``django.setup()``.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "READY_MARKER",
    "Process",
    "ProcessStartError",
    "Rss",
    "kill",
    "start_celery",
    "start_process",
    "start_worker",
    "stop",
    "wait_ready",
    "worker_argv",
]

#: What a worker logs (at INFO level) once it consumes: ``celery@host ready.``
READY_MARKER = " ready."
#: How long :func:`kill` waits for a SIGKILLed process to be reaped.
KILL_REAP_TIMEOUT = 15.0


class Rss(TypedDict):
    """Resident memory of a process tree, in bytes (0 for a process already gone)."""

    master: int
    children: list[int]


class ProcessStartError(RuntimeError):
    """A child exited while starting, or did not become ready in time (the message says which)."""


@dataclass
class Process:
    """One subprocess started by this module: its handle, its log and (for a worker) its node.

    ``name`` is the worker's node name as Celery reports it (``node@host``, what ``ping``
    answers with) or a label for any other process.
    """

    #: Node name (``bench1-ab12@myhost``) or a label (``beat``, ``server``).
    name: str
    #: The command line it was started with.
    argv: list[str]
    proc: subprocess.Popen[bytes]
    #: Where its stdout and stderr go.
    log: Path
    #: Pool processes (``-c``) of a worker; 0 for other processes.
    concurrency: int = 0
    _log_file: IO[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        """Process id of the main process (also its process group id)."""
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """Exit status once it has exited and been reaped, else ``None``."""
        return self.proc.returncode

    def alive(self) -> bool:
        """True while the main process runs."""
        return self.proc.poll() is None

    def log_text(self) -> str:
        """Everything it logged so far ('' if the log is not there)."""
        return read_log(self.log)

    def log_lines(self, pattern: re.Pattern[str]) -> list[str]:
        """The lines of its log ``pattern`` matches (``re.search``)."""
        return [line for line in self.log_text().splitlines() if pattern.search(line)]

    def children(self) -> list[int]:
        """Pids of its direct children (a worker's prefork pool processes)."""
        return _children(self.proc.pid)

    def rss(self) -> Rss:
        """Resident memory in bytes: ``{"master": n, "children": [n, ...]}`` (0 when gone)."""
        return {"master": _rss(self.proc.pid), "children": [_rss(p) for p in self.children()]}


def read_log(path: Path) -> str:
    """A subprocess log, or '' if it is not there (yet)."""
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def start_process(
    argv: Sequence[str],
    *,
    log: Path,
    name: str,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    concurrency: int = 0,
) -> Process:
    """Start ``argv`` in a session of its own, output to ``log`` (truncated first).

    ``env`` replaces the environment (default: this process's); ``PYTHONUNBUFFERED=1`` is
    always set so that readiness markers reach the log when they are printed.
    """
    environment = dict(os.environ if env is None else env)
    environment["PYTHONUNBUFFERED"] = "1"
    log.parent.mkdir(parents=True, exist_ok=True)
    log_file = log.open("wb")
    try:
        proc = subprocess.Popen(
            list(argv),
            cwd=cwd,
            env=environment,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except BaseException:
        log_file.close()
        raise
    return Process(
        name=name,
        argv=list(argv),
        proc=proc,
        log=log,
        concurrency=concurrency,
        _log_file=log_file,
    )


def start_celery(
    app: str,
    args: Sequence[str],
    *,
    log: Path,
    name: str,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    concurrency: int = 0,
) -> Process:
    """``python -m celery -A <app> <args>`` (any sub-command: ``worker``, ``beat``, ...)."""
    argv = [sys.executable, "-m", "celery", "-A", app, *args]
    return start_process(argv, log=log, name=name, env=env, cwd=cwd, concurrency=concurrency)


def worker_argv(
    *,
    node: str,
    concurrency: int,
    pool: str = "prefork",
    queues: Sequence[str] = (),
    include: Sequence[str] = (),
    loglevel: str = "info",
    heartbeat: bool = True,
    beat: bool = False,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The ``celery worker`` arguments :func:`start_worker` uses (mingle and gossip off).

    Mingle and gossip only slow a start down (every worker waits for the others' replies);
    ``heartbeat=False`` also stops the event heartbeats, which nothing here listens to.
    """
    args = ["worker", "-P", pool, "-c", str(concurrency), "-n", f"{node}@%h"]
    if queues:
        args += ["-Q", ",".join(queues)]
    for module in include:
        args += ["--include", module]
    if beat:
        args.append("--beat")
    args += ["--without-mingle", "--without-gossip"]
    if not heartbeat:
        args.append("--without-heartbeat")
    return [*args, "-l", loglevel, *extra_args]


def start_worker(
    app: str,
    *,
    node: str,
    log: Path,
    concurrency: int,
    pool: str = "prefork",
    queues: Sequence[str] = (),
    include: Sequence[str] = (),
    loglevel: str = "info",
    heartbeat: bool = True,
    beat: bool = False,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> Process:
    """Start one ``celery -A <app> worker`` named ``<node>@<this host>``; returns at once.

    ``queues`` empty consumes the app's default queues. Call :func:`wait_ready` before using
    it. ``beat=True`` embeds beat (``--beat``), as a single-worker demo does.
    """
    args = worker_argv(
        node=node,
        concurrency=concurrency,
        pool=pool,
        queues=queues,
        include=include,
        loglevel=loglevel,
        heartbeat=heartbeat,
        beat=beat,
        extra_args=extra_args,
    )
    return start_celery(
        app,
        args,
        log=log,
        name=f"{node}@{socket.gethostname()}",
        env=env,
        cwd=cwd,
        concurrency=concurrency,
    )


def wait_ready(
    processes: Iterable[Process],
    *,
    timeout: float,
    marker: str | None = READY_MARKER,
    ping: Celery | None = None,
    interval: float = 0.2,
) -> None:
    """Wait until every process is ready; raise :class:`ProcessStartError` otherwise.

    Ready means: ``marker`` is in its log (skipped when ``None``; a worker logging at
    WARNING never prints it), then, when ``ping`` (a Celery app on the workers' broker) is
    given, it answers a ping. The pings of a round go out in one broadcast.
    """
    if marker is None and ping is None:
        raise ValueError("wait_ready needs a marker, a Celery app to ping with, or both")
    deadline = time.monotonic() + timeout
    pending = list(processes)
    while pending:
        for process in pending:
            if not process.alive():
                raise ProcessStartError(
                    f"{process.name} exited with status {process.returncode} while starting "
                    f"(log: {process.log}):\n{process.log_text()[-5000:]}"
                )
        marked = [p for p in pending if marker is None or marker in p.log_text()]
        if marked and ping is not None:
            replies = ping.control.ping(destination=[p.name for p in marked], timeout=0.5)
            answered = {name for reply in replies or [] for name in reply}
            ready = {p.name for p in marked if p.name in answered}
        else:
            ready = {p.name for p in marked}
        pending = [p for p in pending if p.name not in ready]
        if not pending:
            return
        if time.monotonic() > deadline:
            names = ", ".join(p.name for p in pending)
            what = "answer a ping" if ping is not None else f"log {marker!r}"
            raise ProcessStartError(
                f"did not {what} within {timeout:.0f} s: {names} (logs: "
                + ", ".join(str(p.log) for p in pending)
                + ")"
            )
        if ping is None or not marked:  # a ping round already waited its 0.5 s
            time.sleep(interval)


def stop(processes: Sequence[Process], timeout: float) -> None:
    """SIGTERM all at once (warm shutdown), wait up to ``timeout``, then SIGKILL each group.

    Every process is reaped and its log closed (see :func:`kill` for one that cannot be).
    """
    for process in processes:
        if process.alive():
            _signal(process.proc.send_signal, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
    kill(processes)


def kill(processes: Sequence[Process], *, reap_timeout: float = KILL_REAP_TIMEOUT) -> None:
    """SIGKILL each process group (pool children too), reap the children, close the logs.

    A process still not reaped ``reap_timeout`` seconds after SIGKILL keeps
    ``returncode is None``: callers that must not leave anything behind check it.
    """
    for process in processes:
        # Each runs in its own session: whatever is left of its group goes too.
        _signal(functools.partial(os.killpg, process.proc.pid), signal.SIGKILL)
    for process in processes:
        try:
            process.proc.wait(timeout=reap_timeout)
        except subprocess.TimeoutExpired:
            pass
        if process._log_file is not None:
            process._log_file.close()
            process._log_file = None


def _signal(send: Callable[[int], None], sig: signal.Signals) -> None:
    try:
        send(sig)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        return [int(p) for p in path.read_text().split()]
    except OSError:
        pass
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids
