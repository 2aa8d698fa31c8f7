"""Bench pools, backlogs, release, result collection and clean-up.

A *backlog* is a number of calls already waiting when the clock starts: pooled calls in a
paused pool, plain calls in a held queue (:mod:`pools.bench.workers`). Pooled backlogs are
put in line by ``apply_async`` (the real gate, timed: the submit rate) for the first calls,
and the rest are copies of the first entry written in bulk (:mod:`pools.bench.bulk_copy`):
the same rows ``enqueue`` writes (entry, demand rows, ``enqueued`` event), with their own
task id and arguments. That keeps a 100,000-entry line affordable and leaves the
admission+settle loop, which is what the workloads time, untouched.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from celery import Task
from django.db import connection, transaction
from django.utils import timezone

from pools.bench.bulk_copy import BULK_SQL, copy_entries
from pools.bench.errors import BenchError
from pools.bench.progress import Progress
from pools.core import admission
from pools.models import Demand, Pool, PoolEvent, QueueEntry

#: Every pool the benchmark creates starts with this; it deletes them (and their rows) after.
PREFIX = "bench-"


class _GaveUp(Exception):
    """:func:`collect`'s ``check`` failed."""


# --------------------------------------------------------------------------- pools


def create_pools(slots: dict[str, int]) -> None:
    """Create (or reset) the bench pools, paused."""
    for name, n in slots.items():
        if not name.startswith(PREFIX):
            raise ValueError(f"bench pools must start with {PREFIX!r}: {name}")
        Pool.objects.update_or_create(
            name=name, defaults={"slots": n, "paused": True, "description": "manage.py pools bench"}
        )


def pause(names: Sequence[str]) -> None:
    """Stop admission in ``names`` (entries keep their place; admitted ones run)."""
    Pool.objects.filter(name__in=list(names)).update(paused=True, updated_at=timezone.now())


def release(names: Sequence[str]) -> float:
    """Unpause ``names`` and run one admission pass over them; returns when it started."""
    started = time.time()
    Pool.objects.filter(name__in=list(names)).update(paused=False, updated_at=timezone.now())
    admission.admit(list(names))
    return started


def held(name: str) -> int:
    """Slots held in pool ``name`` now."""
    return int(Demand.objects.held_slots(Pool.objects.get(name=name).pk))


def wait_idle(names: Sequence[str], timeout: float = 60.0) -> None:
    """Wait until no entry holds slots in ``names`` (after a pause: admitted ones finish)."""
    deadline = time.monotonic() + timeout
    while Demand.objects.held().filter(pool__name__in=list(names)).exists():
        if time.monotonic() > deadline:
            raise BenchError(f"pools {list(names)} still hold slots after {timeout:.0f} s")
        time.sleep(0.05)


# --------------------------------------------------------------------------- backlogs


def submit(
    task: Task,
    count: int,
    args_for: Callable[[int], list[Any]],
    *,
    queue: str,
    start: int = 0,
    options_for: Callable[[int], dict[str, Any]] | None = None,
) -> tuple[list[str], float]:
    """``count`` real ``apply_async`` calls; returns their ids and the calls per second."""
    ids = []
    began = time.perf_counter()
    for j in range(start, start + count):
        extra = options_for(j) if options_for else {}
        ids.append(task.apply_async(tuple(args_for(j)), queue=queue, **extra).id)
    took = time.perf_counter() - began
    return ids, count / took if took > 0 else float("inf")


def entry_times(keys: Mapping[int, str]) -> dict[int, tuple[float, float, float]]:
    """``(admitted_at, started_at, finished_at)`` of each settled entry, by body index."""
    index = {key: i for i, key in keys.items()}
    rows = QueueEntry.objects.filter(key__in=list(index)).values_list(
        "key", "admitted_at", "started_at", "finished_at"
    )
    return {
        index[key]: (admitted.timestamp(), started.timestamp(), finished.timestamp())
        for key, admitted, started, finished in rows.iterator()
        if admitted and started and finished
    }


def backlog(
    task: Task,
    count: int,
    args_for: Callable[[int], list[Any]],
    *,
    queue: str,
    real: int,
    priority_for: Callable[[int], int] | None = None,
) -> tuple[list[str], float]:
    """Put ``count`` calls of pooled ``task`` in its (paused) pool: ``real`` submitted, rest copied.

    Returns the task ids in index order and the submit rate of the real calls.
    """
    real = max(1, min(real, count))

    def options_for(j: int) -> dict[str, Any]:
        return {"pool_options": {"priority": priority_for(j)}} if priority_for else {}

    ids, rate = submit(task, real, args_for, queue=queue, options_for=options_for)
    ids += copy_entries(ids[0], range(real, count), args_for, priority_for)
    return ids, rate


# --------------------------------------------------------------------------- results


def collect(
    app: Any,
    ids: Sequence[str],
    label: str,
    *,
    timeout: float,
    quiet: bool = False,
    check: Callable[[], None] | None = None,
) -> list[dict[str, Any]]:
    """Wait for the results of ``ids`` (a progress bar on stderr); returns the bodies' reports.

    A result read while its writer is still writing it (the file backend writes in place)
    fails to decode: polling starts again for the ids not yet read. ``check`` is called
    between polls and may raise to give up early (e.g. a worker died: its tasks would only
    come back, if ever, after the timeout).
    """
    from kombu.exceptions import DecodeError

    spans: list[dict[str, Any]] = []
    failed: list[str] = []
    pending = set(ids)
    progress = Progress(label, len(ids)) if not quiet else None
    deadline = time.monotonic() + timeout

    def tick() -> None:
        if progress is not None:
            progress.update(len(spans) + len(failed))
        if check is not None:
            try:
                check()
            except Exception as exc:
                raise _GaveUp(str(exc)) from exc

    while pending:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError("no time left")
            for task_id, meta in app.backend.get_many(
                set(pending), timeout=left, interval=0.2, on_interval=tick
            ):
                pending.discard(task_id)
                if meta.get("status") == "SUCCESS" and isinstance(meta.get("result"), dict):
                    spans.append(meta["result"])
                else:
                    failed.append(f"{task_id}: {meta.get('status')} {meta.get('result')!r}"[:300])
                tick()
        except DecodeError:
            time.sleep(0.05)  # a half-written result: read it again
            continue
        except _GaveUp as exc:
            if progress is not None:
                progress.finish(len(spans) + len(failed), "(gave up)")
            raise BenchError(f"{label}: {len(spans)} of {len(ids)} results, then {exc}") from exc
        except Exception as exc:  # celery's TimeoutError and backend errors alike
            if progress is not None:
                progress.finish(len(spans) + len(failed), "(incomplete)")
            raise BenchError(
                f"{label}: {len(spans)} of {len(ids)} results within {timeout:.0f} s ({exc!r})"
            ) from exc
    if progress is not None:
        progress.finish(len(spans) + len(failed))
    if failed:
        raise BenchError(f"{label}: {len(failed)} tasks failed, first: {failed[0]}")
    return spans


# --------------------------------------------------------------------------- clean-up


def bench_pool_names() -> list[str]:
    """Names of the bench pools present in the database."""
    return list(Pool.objects.filter(name__startswith=PREFIX).values_list("name", flat=True))


def remove_pools() -> int:
    """Delete the bench pools with their entries and events; returns the entries deleted.

    Raw ``DELETE`` statements in one transaction (the ORM's cascade would load a 100,000-entry
    line first): the entries with a demand on a bench pool, then the bench pools' demand rows
    (the foreign key is checked at commit), events and pools.
    """
    names = bench_pool_names()
    if not names:
        return 0
    qn = connection.ops.quote_name
    pool_ids = list(Pool.objects.filter(name__in=names).values_list("pk", flat=True))
    entries, demands = qn(QueueEntry._meta.db_table), qn(Demand._meta.db_table)
    in_pools = ", ".join(["%s"] * len(pool_ids))
    with transaction.atomic(), connection.cursor() as cursor:
        if connection.vendor == "mysql":
            # InnoDB checks foreign keys per statement: demand rows before their entries.
            ids = list(
                Demand.objects.filter(pool_id__in=pool_ids)
                .values_list("entry_id", flat=True)
                .distinct()
            )
            deleted = len(ids)
            for start in range(0, len(ids), BULK_SQL):
                chunk = ids[start : start + BULK_SQL]
                marks = ", ".join(["%s"] * len(chunk))
                cursor.execute(f"DELETE FROM {demands} WHERE {qn('entry_id')} IN ({marks})", chunk)
                cursor.execute(f"DELETE FROM {entries} WHERE {qn('queue_id')} IN ({marks})", chunk)
        else:
            cursor.execute(
                f"DELETE FROM {entries} WHERE {qn('queue_id')} IN "
                f"(SELECT {qn('entry_id')} FROM {demands} WHERE {qn('pool_id')} IN ({in_pools}))",
                pool_ids,
            )
            deleted = max(cursor.rowcount, 0)
        cursor.execute(f"DELETE FROM {demands} WHERE {qn('pool_id')} IN ({in_pools})", pool_ids)
        cursor.execute(
            f"DELETE FROM {qn(PoolEvent._meta.db_table)} WHERE {qn('pool')} IN "
            f"({', '.join(['%s'] * len(names))})",
            names,
        )
        Pool.objects.filter(name__in=names).delete()
    return deleted


def forget_results(app: Any, ids: Sequence[str]) -> None:
    """Delete the stored results of ``ids`` from the result backend."""
    backend = app.backend
    client = getattr(backend, "client", None)
    if client is not None and hasattr(backend, "get_key_for_task") and hasattr(client, "pipeline"):
        keys = [backend.get_key_for_task(task_id) for task_id in ids]
        for n in range(0, len(keys), 5000):
            client.delete(*keys[n : n + 5000])
        return
    for task_id in ids:
        try:
            backend.forget(task_id)
        except Exception:  # a backend without forget(): nothing to delete
            return
