"""Where the CPU goes: CPU time of the benchmark's workers, PostgreSQL and Redis per run.

On this kind of machine (2 cores, everything on loopback) a no-op run is bound by CPU, so
the cost of a task is its CPU time summed over every process it touches. Read from
``/proc`` (Linux); elsewhere every figure is ``None`` and the benchmark runs without them.

Groups:

* ``celery main``: the workers' main processes (consume, dispatch to the pool, ack);
* ``pool processes``: their prefork children (the task bodies, result store, and for
  pooled tasks start, settle and the publish of the next admitted message);
* ``postgres`` and ``redis``: every local process of those servers (a server on another
  machine counts as nothing here);
* ``machine``: all CPU time of the machine that was not idle (also the benchmark itself
  and everything else that ran), from ``/proc/stat``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

PROC = Path("/proc")
GROUPS = ("celery main", "pool processes", "postgres", "redis", "machine")
_SERVERS = {"postgres": "postgres", "redis-server": "redis"}


def _ticks_per_second() -> int:
    try:
        return int(os.sysconf("SC_CLK_TCK"))
    except (ValueError, OSError, AttributeError):
        return 100


def _stat(pid: str) -> tuple[str, int, int] | None:
    """``(command name, parent pid, user+system ticks)`` of one process, or None if gone."""
    try:
        raw = (PROC / pid / "stat").read_text()
    except OSError:
        return None
    name = raw[raw.find("(") + 1 : raw.rfind(")")]
    fields = raw[raw.rfind(")") + 2 :].split()
    try:
        return name, int(fields[1]), int(fields[11]) + int(fields[12])
    except (IndexError, ValueError):
        return None


def machine_counters() -> list[int] | None:
    """The machine's CPU time counters (``/proc/stat``: user .. steal, in ticks), or None."""
    try:
        return [int(v) for v in (PROC / "stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None


def _busy(counters: list[int]) -> int:
    """Ticks spent neither idle, waiting for I/O nor stolen by other guests."""
    return sum(counters) - counters[3] - counters[4] - counters[7]


def machine_share(before: list[int] | None) -> dict[str, float] | None:
    """Busy, idle and stolen shares of the machine's CPU time since ``before`` (percent).

    Steal is time the hypervisor gave to other guests: on a shared virtual machine it
    shows when the run was slowed by neighbours rather than by the work measured.
    """
    after = machine_counters()
    if before is None or after is None:
        return None
    delta = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(delta) or 1
    idle = delta[3] + delta[4]  # idle + iowait
    return {
        "busy_percent": round(100 * _busy(delta) / total, 1),
        "idle_percent": round(100 * idle / total, 1),
        "steal_percent": round(100 * delta[7] / total, 1),
    }


def snapshot(worker_pids: Iterable[int]) -> dict[str, float] | None:
    """Cumulative CPU seconds of each group now (None where ``/proc`` cannot be read).

    Besides the group totals, each counted process's own seconds under the key
    ``"<group>@<pid>"``: :func:`per_task_ms` then adds up per-process differences, so a
    process that exits in between (another session's database backend, on a shared
    server) does not make its group's time seem to go backwards.
    """
    counters = machine_counters()
    if counters is None:
        return None
    mains = {int(p) for p in worker_pids}
    ticks = dict.fromkeys(GROUPS, 0)
    per_pid: dict[str, int] = {}
    for pid in os.listdir(PROC):
        if not pid.isdigit():
            continue
        stat = _stat(pid)
        if stat is None:
            continue
        name, ppid, used = stat
        if int(pid) in mains:
            group = "celery main"
        elif ppid in mains:
            group = "pool processes"
        elif name in _SERVERS:
            group = _SERVERS[name]
        else:
            continue
        ticks[group] += used
        per_pid[f"{group}@{pid}"] = used
    ticks["machine"] = _busy(counters)
    hz = _ticks_per_second()
    out = {group: value / hz for group, value in ticks.items()}
    out.update({key: value / hz for key, value in per_pid.items()})
    return out


def per_task_ms(
    before: Mapping[str, float] | None, after: Mapping[str, float] | None, tasks: int
) -> dict[str, float] | None:
    """CPU milliseconds per task of each group between two snapshots.

    With per-process figures (``"<group>@<pid>"``, see :func:`snapshot`) a group's time
    is the sum of its processes' differences: a process that exited in between is left
    out, one that started counts from zero. Without them, the difference of the totals;
    a group that seems to have gone backwards counts as nothing (never a negative cost).
    """
    if before is None or after is None or tasks <= 0:
        return None
    spent = {group: max(after.get(group, 0.0) - before.get(group, 0.0), 0.0) for group in GROUPS}
    per_process = [k for k in after if "@" in k]
    if per_process:
        for group in GROUPS:
            if group != "machine":
                spent[group] = 0.0
        for key in per_process:
            group = key.split("@", 1)[0]
            spent[group] += max(after[key] - before.get(key, 0.0), 0.0)
    return {group: round(spent[group] * 1000 / tasks, 3) for group in GROUPS}
