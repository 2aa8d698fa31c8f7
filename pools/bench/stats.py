"""Pure counting over what the task bodies reported: no database, no Celery, no clock."""

from __future__ import annotations

import heapq
import itertools
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

#: One body's report: ``{"i", "s" (start), "e" (end), "p" (pid), "r" (retries), ...}``.
Span = Mapping[str, Any]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), nearest-rank on the sorted values; nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return float(ordered[rank - 1])


def summary(values: Sequence[float]) -> dict[str, float]:
    """``{"median", "min", "max"}`` of repetitions (nan when there are none)."""
    if not values:
        nan = float("nan")
        return {"median": nan, "min": nan, "max": nan}
    return {
        "median": float(statistics.median(values)),
        "min": float(min(values)),
        "max": float(max(values)),
    }


def median_by_key(rows: Sequence[Mapping[str, float]]) -> dict[str, float] | None:
    """The median of each key over repetitions (None when there are none)."""
    if not rows:
        return None
    return {key: float(statistics.median(row[key] for row in rows)) for key in rows[0]}


def distribution(values: Sequence[float]) -> dict[str, float]:
    """p50 / p95 / p99 / max of one sample, and its size."""
    return {
        "n": float(len(values)),
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "max": max(values) if values else float("nan"),
    }


#: The stages of a pooled task's path that the entry's own times separate (see :func:`stages`).
STAGES = ("end_to_settle", "admitted_to_start", "start_to_body")


def stages(
    spans: Sequence[Span], times: Mapping[int, tuple[float, float, float]]
) -> dict[str, list[float]]:
    """Seconds each pooled task spent in each of :data:`STAGES`, from its body and its entry.

    ``times[i]`` is the entry of body ``i``: when it was admitted, when the worker's start
    call began and when the settle call began (``admitted_at``, ``started_at``,
    ``finished_at``: each the clock of the call that wrote it, taken before its SQL). So:

    * ``end_to_settle``: body end -> settle call (Celery stores the result, ``task_postrun``);
    * ``admitted_to_start``: admission -> start call (the admitting transaction's SQL and
      commit, the publish, the broker, the worker's main process, the pool process);
    * ``start_to_body``: start call -> body start (the start's SQL and commit).
    """
    out: dict[str, list[float]] = {name: [] for name in STAGES}
    for span in spans:
        entry = times.get(int(span["i"]))
        if entry is None:
            continue
        admitted, started, settled = entry
        out["end_to_settle"].append(settled - float(span["e"]))
        out["admitted_to_start"].append(started - admitted)
        out["start_to_body"].append(float(span["s"]) - started)
    return out


def stage_summary(runs: Sequence[Mapping[str, Sequence[float]]]) -> dict[str, dict[str, Any]]:
    """p50 and p99 of each stage in each repetition, as median/min/max over the repetitions."""
    if not runs:
        return {}
    per_rep = [{name: distribution(run[name]) for name in STAGES} for run in runs]
    return {
        name: {q: summary([rep[name][q] for rep in per_rep]) for q in ("p50", "p99")}
        for name in STAGES
    }


def check_complete(spans: Sequence[Span], expected: Iterable[int]) -> None:
    """Raise unless every expected index reported exactly once."""
    want = sorted(expected)
    got = sorted(int(s["i"]) for s in spans)
    if got != want:
        missing = sorted(set(want) - set(got))
        extra = len(got) - len(set(got))
        raise AssertionError(
            f"expected {len(want)} bodies, got {len(got)} ({len(missing)} missing, "
            f"{extra} duplicated; first missing: {missing[:5]})"
        )


def throughput(spans: Sequence[Span]) -> float:
    """Tasks per second from the start of the first body to the end of the last one.

    The clock starts with the work, not with the release of the backlog: how a backlog is
    released differs between the sides (a pool's unpause and admission pass; for plain
    Celery the workers' ``add_consumer``, which takes from a few to hundreds of
    milliseconds to reach them) and is not what is measured. See :func:`start_lag`.
    """
    if not spans:
        return 0.0
    first = min(float(s["s"]) for s in spans)
    last = max(float(s["e"]) for s in spans)
    return len(spans) / max(last - first, 1e-9)


def start_lag(spans: Sequence[Span], released_at: float) -> float:
    """Seconds from the release of the backlog to the start of the first body."""
    if not spans:
        return 0.0
    return min(float(s["s"]) for s in spans) - released_at


def serial_gaps(spans: Sequence[Span]) -> list[float]:
    """Seconds from each body's end to the next body's start, in start order (N-1 gaps)."""
    ordered = sorted(spans, key=lambda s: float(s["s"]))
    return [float(b["s"]) - float(a["e"]) for a, b in itertools.pairwise(ordered)]


def gaps_after(spans: Sequence[Span], marks: Mapping[Any, float], key: str = "i") -> list[float]:
    """Seconds from ``marks[previous body]`` (e.g. its settle) to the next body's start."""
    ordered = sorted(spans, key=lambda s: float(s["s"]))
    return [
        float(b["s"]) - marks[a[key]] for a, b in itertools.pairwise(ordered) if a[key] in marks
    ]


def max_concurrency(spans: Sequence[Span]) -> int:
    """Most bodies running at once (an end at the same instant as a start is applied first)."""
    points = sorted(
        [(float(s["s"]), 1) for s in spans] + [(float(s["e"]), -1) for s in spans],
        key=lambda p: (p[0], p[1]),
    )
    current = peak = 0
    for _at, step in points:
        current += step
        peak = max(peak, current)
    return peak


def handoff_gaps(spans: Sequence[Span], acquire: str = "s", release: str = "e") -> list[float]:
    """Idle time of a freed slot while work waits: each release matched to the next acquire.

    Every span is in the backlog from the start, so after a release someone is waiting until
    the last acquire. A release frees one slot; the next acquire (in time order) takes the
    longest-free slot. Acquires with no earlier release (the initial fill) are not counted.
    """
    last_acquire = max((float(s[acquire]) for s in spans), default=0.0)
    events = sorted(
        [(float(s[release]), 0) for s in spans if float(s[release]) < last_acquire]
        + [(float(s[acquire]), 1) for s in spans],
    )
    free: list[float] = []
    gaps: list[float] = []
    for at, is_acquire in events:
        if not is_acquire:
            free.append(at)
        elif free:
            gaps.append(at - free.pop(0))
    return gaps


def inversions(items: Iterable[tuple[int, float, float]]) -> int:
    """Acquisitions made by a lower priority while a higher priority was waiting.

    ``items`` are ``(priority, queued, acquired)``, one per task, where ``queued`` and
    ``acquired`` are points on one scale: one clock, or better one sequence (pool event ids,
    a Redis counter), since only their order matters. A task waits from ``queued`` until
    ``acquired``. An acquisition counts once, however many tasks it overtook, if some task
    of strictly higher priority was waiting at that point: queued before it and acquired
    after it (both strictly, so acquisitions at the same point are never counted against each
    other, and a task queued at the very point of an acquisition was not yet waiting).
    """
    by_acquired = sorted(items, key=lambda item: item[2])
    by_queued = sorted(by_acquired, key=lambda item: item[1])
    waiting: list[tuple[int, float]] = []  # heap of (-priority, acquired) of queued tasks
    next_queued = 0
    count = 0
    for priority, _queued, acquired in by_acquired:
        while next_queued < len(by_queued) and by_queued[next_queued][1] < acquired:
            p, _q, a = by_queued[next_queued]
            heapq.heappush(waiting, (-p, a))
            next_queued += 1
        # Tasks that have acquired by now (this one included) no longer wait.
        while waiting and waiting[0][1] <= acquired:
            heapq.heappop(waiting)
        if waiting and -waiting[0][0] > priority:
            count += 1
    return count
