"""pools.celery.processes: start, readiness, stop (SIGTERM then SIGKILL), logs, reaping.

Real subprocesses, no broker and no database: small Python scripts stand in for workers
where a behaviour has to be forced (ignoring SIGTERM, a pool child, dying at start), and one
real ``celery worker`` on the in-memory transport checks the readiness marker and the warm
shutdown end to end.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from pools.celery import processes

#: A stand-in worker: logs a marker, forks one "pool" child, then sleeps. With ``stubborn``
#: it ignores SIGTERM (so only SIGKILL ends it), else it exits 0 on SIGTERM.
SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    stubborn = sys.argv[1] == "stubborn"
    delay = float(sys.argv[2])
    if stubborn:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    child = os.fork()
    if child == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the pool child outlives a plain kill
        time.sleep(120)
        os._exit(0)
    with open(sys.argv[3], "w") as f:
        f.write(str(child))
    time.sleep(delay)
    print("ERROR/MainProcess something failed")
    print("node@host ready.")
    time.sleep(120)
    """
)


def _fake(tmp_path: Path, name: str, *, stubborn: bool = False, delay: float = 0.0) -> Any:
    script = tmp_path / "fake_worker.py"
    script.write_text(SCRIPT)
    child_file = tmp_path / f"{name}.child"
    process = processes.start_process(
        [
            sys.executable,
            str(script),
            "stubborn" if stubborn else "polite",
            str(delay),
            str(child_file),
        ],
        log=tmp_path / f"{name}.log",
        name=name,
    )
    return process, child_file


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers signal 0; /proc says whether it is one.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_file(path: Path, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{path} was never written")


def test_worker_argv__names_the_node_queues_includes_and_flags() -> None:
    argv = processes.worker_argv(
        node="bench1-ab",
        concurrency=4,
        queues=["a", "b"],
        include=["pools.bench.tasks"],
        loglevel="warning",
        heartbeat=False,
        extra_args=["--disable-prefetch"],
    )
    assert argv == [
        "worker",
        "-P",
        "prefork",
        "-c",
        "4",
        "-n",
        "bench1-ab@%h",
        "-Q",
        "a,b",
        "--include",
        "pools.bench.tasks",
        "--without-mingle",
        "--without-gossip",
        "--without-heartbeat",
        "-l",
        "warning",
        "--disable-prefetch",
    ]


def test_worker_argv__defaults_keep_heartbeat_and_queues_and_can_embed_beat() -> None:
    argv = processes.worker_argv(node="demo", concurrency=2, pool="threads", beat=True)
    assert "-Q" not in argv and "--without-heartbeat" not in argv
    assert argv[:7] == ["worker", "-P", "threads", "-c", "2", "-n", "demo@%h"]
    assert "--beat" in argv and argv[-2:] == ["-l", "info"]


def test_start_worker__node_name_is_the_one_celery_reports(tmp_path: Path) -> None:
    process = processes.start_worker(
        "no_such_app_module", node="n1", log=tmp_path / "w.log", concurrency=1, cwd=tmp_path
    )
    try:
        assert process.name == f"n1@{socket.gethostname()}"
        assert process.concurrency == 1
        assert process.argv[1:5] == ["-m", "celery", "-A", "no_such_app_module"]
    finally:
        processes.stop([process], 5)


def test_wait_ready__marker_in_log(tmp_path: Path) -> None:
    process, _ = _fake(tmp_path, "ready", delay=0.3)
    try:
        assert " ready." not in process.log_text()
        processes.wait_ready([process], timeout=10)
        assert " ready." in process.log_text()
        assert process.log_lines(re.compile(r"ERROR/")) == ["ERROR/MainProcess something failed"]
    finally:
        processes.stop([process], 5)


def test_wait_ready__a_process_that_exits_raises_with_its_log(tmp_path: Path) -> None:
    process = processes.start_process(
        [sys.executable, "-c", "import sys; print('ImportError: no app'); sys.exit(3)"],
        log=tmp_path / "dies.log",
        name="dies",
    )
    with pytest.raises(processes.ProcessStartError, match=r"(?s)dies exited with status 3.*no app"):
        processes.wait_ready([process], timeout=10)
    processes.stop([process], 1)


def test_wait_ready__times_out_naming_the_slow_one(tmp_path: Path) -> None:
    process, _ = _fake(tmp_path, "slow", delay=30)
    try:
        with pytest.raises(
            processes.ProcessStartError, match=re.escape("did not log ' ready.' within 1 s: slow")
        ):
            processes.wait_ready([process], timeout=1)
    finally:
        processes.stop([process], 5)


def test_wait_ready__needs_a_marker_or_a_ping() -> None:
    with pytest.raises(ValueError, match="marker"):
        processes.wait_ready([], timeout=1, marker=None, ping=None)


def test_stop__warm_shutdown_then_the_group_is_killed_and_reaped(tmp_path: Path) -> None:
    process, child_file = _fake(tmp_path, "polite")
    processes.wait_ready([process], timeout=10)
    child = int(_wait_file(child_file))
    assert process.children() == [child] and _pid_alive(child)
    assert process.rss()["master"] > 0

    started = time.monotonic()
    processes.stop([process], timeout=10)
    assert time.monotonic() - started < 5  # exited on SIGTERM, no need to wait for the kill
    assert process.returncode == 0 and not process.alive()
    # The pool child ignored SIGTERM; the group SIGKILL took it too.
    deadline = time.monotonic() + 5
    while _pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pid_alive(child)
    assert process._log_file is None  # the log is closed


def test_stop__sigkill_after_the_timeout_when_sigterm_is_ignored(tmp_path: Path) -> None:
    stubborn, _ = _fake(tmp_path, "stubborn", stubborn=True)
    polite, _ = _fake(tmp_path, "polite")
    processes.wait_ready([stubborn, polite], timeout=10)

    started = time.monotonic()
    processes.stop([stubborn, polite], timeout=1.0)
    elapsed = time.monotonic() - started
    assert 1.0 <= elapsed < 10
    assert stubborn.returncode == -9  # killed
    assert polite.returncode == 0  # warm shutdown
    processes.stop([stubborn, polite], timeout=1.0)  # stopping twice is harmless


def test_kill__no_warm_shutdown(tmp_path: Path) -> None:
    process, _ = _fake(tmp_path, "killed")
    processes.wait_ready([process], timeout=10)
    processes.kill([process])
    assert process.returncode == -9


MINI_APP = """
from celery import Celery

app = Celery("mini", broker="memory://", backend="cache+memory://")
"""


def test_real_worker__ready_marker_then_warm_shutdown(tmp_path: Path) -> None:
    (tmp_path / "mini_app.py").write_text(MINI_APP)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("CELERY_") and k != "DJANGO_SETTINGS_MODULE"
    }
    env["PYTHONPATH"] = str(tmp_path)
    worker = processes.start_worker(
        "mini_app",
        node="unit",
        log=tmp_path / "unit.log",
        concurrency=1,
        pool="solo",
        env=env,
        cwd=tmp_path,
    )
    try:
        processes.wait_ready([worker], timeout=60)
        assert f"{worker.name} ready." in worker.log_text()
    finally:
        processes.stop([worker], timeout=20)
    assert worker.returncode == 0, worker.log_text()
