"""Bulk copies of a waiting entry: the rows ``enqueue`` wrote for it (entry, demand rows,
``enqueued`` event), each copy with its own task id, arguments and priority, and its
place in line set by the pool's strategy.

A pooled backlog (:mod:`pools.bench.backlog`) puts its first calls in line through the
real gate and writes the rest as copies: that keeps a 100,000-entry line affordable. On
PostgreSQL a chunk is one ``INSERT ... SELECT`` per table in one statement; elsewhere
``bulk_create``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from celery.utils import uuid
from django.db import connection, transaction
from django.utils import timezone

from pools.bench.errors import BenchError
from pools.bench.progress import Progress
from pools.celery import messages
from pools.core import strategies
from pools.models import Demand, Pool, PoolEvent, QueueEntry, Strategy
from pools.states import EntryState, EventKind

#: Entries per ``bulk_create`` when writing a backlog in bulk; per statement on PostgreSQL.
BULK = 2000


BULK_SQL = 10000


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
