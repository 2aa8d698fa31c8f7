"""The benchmark's CPU accounting (``pools.bench.cpu``) and how the report shows it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pools.bench import cpu, report, stats


def _fake_proc(root: Path, processes: dict[int, tuple[str, int, int, int]], stat: str) -> None:
    """``processes``: pid -> (command name, parent pid, user ticks, system ticks)."""
    root.mkdir(exist_ok=True)
    (root / "stat").write_text(stat)
    for pid, (name, ppid, utime, stime) in processes.items():
        (root / str(pid)).mkdir(exist_ok=True)
        # Fields after "(name)": state ppid pgrp session tty tpgid flags minflt cminflt
        # majflt cmajflt utime stime ...
        rest = ["S", ppid, 1, 1, 0, -1, 0, 0, 0, 0, 0, utime, stime, 0, 0, 20, 0, 1]
        (root / str(pid) / "stat").write_text(f"{pid} ({name}) " + " ".join(map(str, rest)))
    (root / "self").mkdir(exist_ok=True)  # not a pid: ignored


def test_snapshot__groups_workers_their_children_and_the_servers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hz = os.sysconf("SC_CLK_TCK")
    _fake_proc(
        tmp_path,
        {
            10: ("python", 1, hz, 0),  # a worker's main process
            11: ("python", 10, 2 * hz, hz),  # its pool processes
            12: ("python", 10, hz, 0),
            20: ("postgres", 1, hz, hz),
            21: ("redis-server", 1, 0, hz),
            30: ("a name) with (parens", 1, 9 * hz, 0),  # someone else: only in "machine"
        },
        # user nice system idle iowait irq softirq steal
        f"cpu  {5 * hz} 0 {hz} {50 * hz} {3 * hz} 0 0 {7 * hz} 0 0\ncpu0 1 2 3\n",
    )
    monkeypatch.setattr(cpu, "PROC", tmp_path)

    seconds = cpu.snapshot([10])

    assert seconds is not None
    assert {k: v for k, v in seconds.items() if "@" not in k} == {
        "celery main": 1.0,
        "pool processes": 4.0,
        "postgres": 2.0,
        "redis": 1.0,
        "machine": 6.0,  # idle, iowait and steal are not busy
    }


def test_snapshot__none_without_proc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "PROC", tmp_path / "missing")
    assert cpu.snapshot([1]) is None


def test_per_task_ms__difference_per_task_and_never_negative() -> None:
    before = {
        "celery main": 1.0,
        "pool processes": 2.0,
        "postgres": 5.0,
        "redis": 0.0,
        "machine": 9.0,
    }
    after = {
        "celery main": 1.5,
        "pool processes": 3.0,
        "postgres": 4.0,
        "redis": 0.1,
        "machine": 11.0,
    }

    per_task = cpu.per_task_ms(before, after, tasks=100)

    assert per_task == {
        "celery main": 5.0,
        "pool processes": 10.0,
        "postgres": 0.0,  # a backend exited and took its time with it
        "redis": 1.0,
        "machine": 20.0,
    }
    assert cpu.per_task_ms(None, after, 100) is None
    assert cpu.per_task_ms(before, after, 0) is None


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc (Linux)")
def test_snapshot__counts_a_real_child_process_busy_on_the_cpu() -> None:
    """A child of a 'worker' spinning for 0.3 s shows up as pool-process CPU time."""
    spin = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass"
    # The "worker" is this test process; the spinning child is its pool process.
    before = cpu.snapshot([os.getpid()])
    child = subprocess.Popen([sys.executable, "-c", spin + "\nimport time; time.sleep(2)"])
    try:
        time.sleep(1.2)  # spinning done, child still alive (its time still counted)
        after = cpu.snapshot([os.getpid()])
    finally:
        child.kill()
        child.wait()
    assert before is not None and after is not None
    spent = after["pool processes"] - before["pool processes"]
    assert 0.25 <= spent <= 1.0
    assert after["machine"] - before["machine"] >= spent - 0.05


def test_median_by_key() -> None:
    rows = [{"a": 1.0, "b": 10.0}, {"a": 3.0, "b": 30.0}, {"a": 2.0, "b": 5.0}]
    assert stats.median_by_key(rows) == {"a": 2.0, "b": 10.0}
    assert stats.median_by_key([]) is None


def test_report__cpu_rows_show_pooled_with_plain_in_the_label() -> None:
    cpu_ms = {
        "plain": {"machine": 3.25, "postgres": 0.0},
        "pooled": {"machine": 7.5, "postgres": 2.0},
    }
    rows = report._cpu_rows("no-op", cpu_ms)
    assert [(r[1], r[2], r[3]) for r in rows] == [
        ("no-op: CPU/task machine (plain 3.25)", 7.5, "ms CPU"),
        ("no-op: CPU/task postgres (plain 0.00)", 2.0, "ms CPU"),
    ]
    assert report._cpu_rows("no-op", {"plain": None, "pooled": cpu_ms["pooled"]}) == []


def test_per_task_ms__per_process_a_backend_that_exits_is_left_out():
    before = {
        "celery main": 1.0, "pool processes": 2.0, "postgres": 105.0, "redis": 0.0,
        "machine": 9.0,
        "celery main@10": 1.0, "pool processes@11": 2.0,
        "postgres@20": 5.0, "postgres@21": 100.0,  # 21: another session's backend
    }  # fmt: skip
    after = {
        "celery main": 1.5, "pool processes": 3.0, "postgres": 7.0, "redis": 0.0,
        "machine": 11.0,
        "celery main@10": 1.5, "pool processes@11": 3.0,
        "postgres@20": 6.0, "postgres@22": 1.0,  # 21 exited, 22 started
    }  # fmt: skip

    per_task = cpu.per_task_ms(before, after, tasks=100)

    assert per_task == {
        "celery main": 5.0,
        "pool processes": 10.0,
        "postgres": 20.0,  # 20 spent 1 s, 22 spent 1 s; 21's exit is not a negative cost
        "redis": 0.0,
        "machine": 20.0,
    }
