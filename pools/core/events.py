"""The append-only event log, and the Django signals sent for each event after commit.

Both admission paths go through :func:`announce`: the ORM path with the rows it has just
inserted, the stored functions with the rows they return. Signals are sent only when
the transaction that wrote the rows commits (``transaction.on_commit``), in the order
the rows were written, and never for work that was rolled back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from django.db import transaction

from pools import signals
from pools.models import EventKind, PoolEvent, QueueEntry


def record(
    kind: EventKind,
    entries: Iterable[QueueEntry],
    *,
    at: datetime,
    detail: dict[str, Any] | None = None,
) -> None:
    """Append one event per (entry, pool) pair and send the matching signal on commit."""
    rows = [
        PoolEvent(
            at=at,
            kind=kind,
            pool=pool,
            entry_id=entry.queue_id,
            key=entry.key,
            token=entry.token,
            detail={"slots": slots, **(detail or {})},
        )
        for entry in entries
        for pool, slots in entry.demand.items()
    ]
    save_rows(kind, rows)


def record_pool(kind: EventKind, pool: str, *, at: datetime, detail: dict[str, Any]) -> None:
    """Append one pool-level event (capacity changed, paused)."""
    save_rows(kind, [PoolEvent(at=at, kind=kind, pool=pool, detail=detail)])


def save_rows(kind: EventKind, rows: list[PoolEvent]) -> None:
    """Insert event rows (all of ``kind``) and send their signal after commit."""
    if not rows:
        return
    PoolEvent.objects.bulk_create(rows)
    announce(rows)


def announce(rows: Sequence[PoolEvent]) -> None:
    """Send each row's lifecycle signal when the current transaction commits, in order.

    Rows of kinds nobody listens to cost nothing. Inside a savepoint that is rolled
    back, Django drops the callback: no signal for rolled-back work.
    """
    wanted = [
        (signal, row)
        for row in rows
        if (signal := signals.BY_KIND.get(row.kind)) is not None and signal.has_listeners(PoolEvent)
    ]
    if not wanted:
        return

    def send() -> None:
        for signal, row in wanted:
            signal.send(sender=PoolEvent, event=row)

    transaction.on_commit(send)
