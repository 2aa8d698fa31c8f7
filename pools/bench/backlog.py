"""Bench pools, backlogs, release, result collection and clean-up.

A *backlog* is a number of calls already waiting when the clock starts: pooled calls in a
paused pool, plain calls in a held queue (:mod:`pools.bench.workers`). Pooled backlogs are
put in line by ``apply_async`` (the real gate, timed: the submit rate) for the first calls,
and the rest are copies of the first entry written in bulk: the same rows ``enqueue`` writes
(entry, demand rows, ``enqueued`` event), with their own task id and arguments. That keeps
a 100,000-entry line affordable and leaves the admission+settle loop, which is what the
workloads time, untouched.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from celery import Task
from celery.utils import uuid
from django.db import OperationalError, connection, transaction
from django.utils import timezone

from pools.bench.progress import Progress
from pools.celery import messages
from pools.core import admission, strategies
from pools.models import Demand, Pool, PoolEvent, QueueEntry, Strategy
from pools.states import EntryState, EventKind

#: Every pool the benchmark creates starts with this; it deletes them (and their rows) after.
PREFIX = "bench-"
#: Entries per ``bulk_create`` when writing a backlog in bulk; per statement on PostgreSQL.
BULK = 2000
BULK_SQL = 10000


class BenchError(RuntimeError):
    """A workload could not be measured (a body failed, a worker died, a timeout)."""


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


def copy_entries(
    template_key: str,
    indexes: Sequence[int],
    args_for: Callable[[int], list[Any]],
    priority_for: Callable[[int], int] | None = None,
    label: str = "",
) -> list[str]:
    """Write waiting copies of entry ``template_key`` (one per index) in bulk; returns the keys.

    Each copy gets its own task id, arguments and priority; everything else (and its demand
    rows and ``enqueued`` events) is copied from the template's rows, so the copies are the
    rows ``enqueue`` wrote for it. On PostgreSQL a chunk is one ``INSERT ... SELECT`` per
    table in one statement (100,000 entries take seconds); elsewhere ``bulk_create``.
    The pools it names must be paused (or the copies wait until the next admission pass).
    """
    template = QueueEntry.objects.get(key=template_key)
    keys: list[str] = []
    progress = Progress(label, len(indexes)) if label else None
    fast = connection.vendor == "postgresql"
    size = BULK_SQL if fast else BULK
    for chunk_start in range(0, len(indexes), size):
        chunk = indexes[chunk_start : chunk_start + size]
        new_keys = [uuid() for _ in chunk]
        args = [args_for(j) for j in chunk]
        priorities = [priority_for(j) if priority_for else template.priority for j in chunk]
        options = [_options_for(template, key, a) for key, a in zip(new_keys, args, strict=True)]
        if fast:
            _copy_sql(template, new_keys, args, priorities, options)
        else:
            _copy_orm(template, new_keys, args, priorities, options)
        keys.extend(new_keys)
        if progress is not None:
            progress.update(len(keys))
    if progress is not None:
        progress.finish(len(keys))
    return keys


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


def scalar(sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> Any:
    """The first column of the first row of ``sql`` (None when there is no row)."""
    with connection.cursor() as cursor:
        cursor.execute(sql, params if isinstance(params, dict) else list(params))
        row = cursor.fetchone()
    return row[0] if row else None


def wal_position() -> str | None:
    """PostgreSQL's current write-ahead log position (None on other databases)."""
    if connection.vendor != "postgresql":
        return None
    return str(scalar("SELECT pg_current_wal_lsn()::text"))


#: WAL records of this database since a position: those that touch its relations, and
#: every record (commits included) of the transactions that wrote those (pg_walinspect).
_OWN_WAL = """
WITH r AS (
    SELECT xid, record_length, block_ref LIKE %(rel)s AS here
      FROM pg_get_wal_records_info(%(start)s::pg_lsn, pg_current_wal_lsn())
), mine AS (SELECT DISTINCT xid FROM r WHERE here AND xid <> '0')
SELECT COALESCE(sum(record_length), 0) FROM r WHERE here OR xid IN (SELECT xid FROM mine)
"""


def wal_bytes_since(position: str | None) -> float | None:
    """Bytes of write-ahead log written since ``position``.

    With the ``pg_walinspect`` extension in the database (PostgreSQL 15+), only the WAL
    of this database's work counts: other databases of the same server (a shared machine's
    test runs) write WAL too. Without it, everything every session wrote. ``None`` when
    the server has already recycled the WAL since ``position`` (a busy server: raise
    ``wal_keep_size`` to measure it).
    """
    if position is None:
        return None
    if scalar("SELECT count(*) FROM pg_extension WHERE extname = 'pg_walinspect'"):
        dboid = scalar("SELECT oid FROM pg_database WHERE datname = current_database()")
        try:
            with transaction.atomic():
                return float(scalar(_OWN_WAL, {"rel": f"%/{dboid}/%", "start": position}))
        except OperationalError as exc:
            if "has already been removed" not in str(exc):
                raise
            return None
    return float(scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)", [position]))


def settle_tables(*, checkpoint: bool = True) -> None:
    """``VACUUM ANALYZE`` the queue tables, then ``CHECKPOINT`` (PostgreSQL; outside the clock).

    After a bulk load: a line of 100,000 entries written in seconds leaves the planner's
    statistics stale and a checkpoint's worth of dirty pages; a queue that grew to that
    depth over time has neither, and the depth workload should time admission at that
    depth, not the database catching up with the load.

    Before each pooled repetition (``checkpoint=False``): every admission, start and
    settle leaves dead row versions behind. On a production server autovacuum removes
    them about once a minute; on a server where it is off (CI configurations often turn
    it off) they pile up over the run and each repetition would be slower than the last.
    """
    if connection.vendor != "postgresql":
        return
    tables = [m._meta.db_table for m in (QueueEntry, Demand, PoolEvent)]
    with connection.cursor() as cursor:
        for table in tables:
            cursor.execute(f"VACUUM ANALYZE {table}")
        if checkpoint:
            cursor.execute("CHECKPOINT")


def _options_for(template: QueueEntry, key: str, args: list[Any]) -> dict[str, Any]:
    """The template's held message re-addressed: its own task id and arguments."""
    held = messages.held_in(template.options)
    if held is None:
        return dict(template.options)
    copied = messages.copy_for(held, key, args)
    return {**template.options, messages.OPTION_KEY: copied.to_json()}


def _copy_orm(
    template: QueueEntry,
    keys: list[str],
    args: list[list[Any]],
    priorities: list[int],
    options: list[dict[str, Any]],
) -> None:
    demands = list(Demand.objects.filter(entry=template).values("pool_id", "slots"))
    pools = {p.pk: p for p in Pool.objects.filter(pk__in=[d["pool_id"] for d in demands])}
    logged = PoolEvent.objects.filter(entry_id=template.queue_id, kind=EventKind.ENQUEUED)
    events = list(logged.values("pool", "token", "detail"))
    now = timezone.now()
    entries = [
        QueueEntry(
            key=key,
            task_name=template.task_name,
            args=a,
            kwargs=template.kwargs,
            options=opts,
            demand=template.demand,
            state=EntryState.WAITING,
            priority=priority,
            enqueued_at=now,
            origin=template.origin,
            root_id=template.root_id,
            parent_id=template.parent_id,
        )
        for key, a, priority, opts in zip(keys, args, priorities, options, strict=True)
    ]
    with transaction.atomic():
        QueueEntry.objects.bulk_create(entries)
        rows = []
        for e in entries:
            for d in demands:
                line_round, line_at, key = strategies.place(
                    pools[d["pool_id"]], priority=e.priority, at=now, key=""
                )
                rows.append(
                    Demand(
                        entry_id=e.queue_id,
                        pool_id=d["pool_id"],
                        slots=d["slots"],
                        priority=e.priority,
                        enqueued_at=now,
                        line_round=line_round,
                        line_at=line_at,
                        fairness_key=key,
                    )
                )
        Demand.objects.bulk_create(rows)
        PoolEvent.objects.bulk_create(
            PoolEvent(at=now, kind=EventKind.ENQUEUED, entry_id=e.queue_id, key=e.key, **ev)
            for e in entries
            for ev in events
        )


def _places_sql(template: QueueEntry) -> tuple[str, str]:
    """SQL for a copy's ``(line_round, line_at)`` in each of the template's pools, as
    :func:`pools.core.strategies.place` gives them (``new`` is the copy, ``d`` the
    template's demand row). A ``fair`` pool keeps the template's round: the copies share it.
    """
    rounds, ats = [], []
    for pool in Pool.objects.filter(name__in=list(template.demand)):
        aging = strategies.aging_of(pool)
        if pool.strategy == Strategy.PRIORITY and aging:
            rounds.append(f"WHEN {pool.pk} THEN 0")
            ats.append(
                f"WHEN {pool.pk} THEN %(now)s - make_interval(secs => new.priority * {aging})"
            )
        elif pool.strategy == Strategy.PRIORITY:
            rounds.append(f"WHEN {pool.pk} THEN -new.priority")
        elif pool.strategy == Strategy.FIFO:
            rounds.append(f"WHEN {pool.pk} THEN 0")
        elif pool.strategy == Strategy.LIFO:
            rounds.append(f"WHEN {pool.pk} THEN -%(micros)s")
    round_sql = f"CASE d.pool_id {' '.join(rounds)} ELSE d.line_round END" if rounds else ""
    at_sql = f"CASE d.pool_id {' '.join(ats)} ELSE %(now)s END" if ats else "%(now)s"
    return round_sql or "d.line_round", at_sql


def _columns(model: Any, overrides: dict[str, str], alias: str) -> tuple[str, str]:
    """``(column list, select list)`` copying every column but the primary key (and generated
    columns, which the database computes) from ``alias``."""
    qn = connection.ops.quote_name
    names = [
        f.column
        for f in model._meta.concrete_fields
        if not f.primary_key and not getattr(f, "generated", False)
    ]
    select = [overrides.get(name, f"{alias}.{qn(name)}") for name in names]
    return ", ".join(qn(n) for n in names), ", ".join(select)


def _copy_sql(
    template: QueueEntry,
    keys: list[str],
    args: list[list[Any]],
    priorities: list[int],
    options: list[dict[str, Any]],
) -> None:
    """One statement: the entries, their demand rows and ``enqueued`` events, from the template's."""
    qn = connection.ops.quote_name
    entry_cols, entry_select = _columns(
        QueueEntry,
        {
            "key": "src.key",
            "args": "src.args::jsonb",
            "options": "src.options::jsonb",
            "priority": "src.priority",
            "state": "%(waiting)s",
            "enqueued_at": "%(now)s",
        },
        "t",
    )
    line_round, line_at = _places_sql(template)
    demand_cols, demand_select = _columns(
        Demand,
        {
            "entry_id": "new.queue_id",
            "priority": "new.priority",
            "state": "%(waiting)s",
            "enqueued_at": "%(now)s",
            "line_round": line_round,
            "line_at": line_at,
        },
        "d",
    )
    event_cols, event_select = _columns(
        PoolEvent, {"entry_id": "new.queue_id", "key": "new.key", "at": "%(now)s"}, "ev"
    )
    entries, demands, events = (qn(m._meta.db_table) for m in (QueueEntry, Demand, PoolEvent))
    sql = f"""
        WITH src AS (
            SELECT * FROM unnest(%(keys)s::text[], %(args)s::text[], %(priorities)s::int[],
                                 %(options)s::text[])
                WITH ORDINALITY AS s(key, args, priority, options, n)
        ), new AS (
            INSERT INTO {entries} ({entry_cols})
            SELECT {entry_select} FROM src CROSS JOIN {entries} t
             WHERE t.{qn("queue_id")} = %(template)s ORDER BY src.n
            RETURNING {qn("queue_id")}, {qn("key")}, {qn("priority")}
        ), dem AS (
            INSERT INTO {demands} ({demand_cols})
            SELECT {demand_select} FROM new CROSS JOIN {demands} d
             WHERE d.{qn("entry_id")} = %(template)s
            RETURNING 1
        ), ev AS (
            INSERT INTO {events} ({event_cols})
            SELECT {event_select} FROM new CROSS JOIN {events} ev
             WHERE ev.{qn("entry_id")} = %(template)s AND ev.{qn("kind")} = %(enqueued)s
            RETURNING 1
        )
        SELECT (SELECT count(*) FROM new), (SELECT count(*) FROM dem), (SELECT count(*) FROM ev)
    """
    encoder = QueueEntry._meta.get_field("args").encoder
    now = timezone.now()
    params: dict[str, Any] = {
        "keys": keys,
        "args": [json.dumps(a, cls=encoder) for a in args],
        "options": [json.dumps(o, cls=encoder) for o in options],
        "priorities": priorities,
        "waiting": EntryState.WAITING.value,
        "now": now,
        "micros": strategies.micros(now),
        "template": template.queue_id,
        "enqueued": EventKind.ENQUEUED.value,
    }
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    if not row or int(row[0]) != len(keys):
        raise BenchError(f"copying entry {template.key}: wrote {row} rows for {len(keys)} copies")


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
