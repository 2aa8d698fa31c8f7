"""The append-only event log, and the Django signals sent for each event after commit."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.db import transaction

from pools import signals
from pools.models import PoolEvent, QueueEntry


def record(
    kind: str,
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


def record_pool(kind: str, pool: str, *, at: datetime, detail: dict[str, Any]) -> None:
    """Append one pool-level event (capacity changed, paused)."""
    save_rows(kind, [PoolEvent(at=at, kind=kind, pool=pool, detail=detail)])


def save_rows(kind: str, rows: list[PoolEvent]) -> None:
    """Insert event rows and send their signal after commit."""
    if not rows:
        return
    PoolEvent.objects.bulk_create(rows)
    signal = signals.BY_KIND.get(kind)
    if signal is not None and signal.has_listeners(PoolEvent):

        def send() -> None:
            for row in rows:
                signal.send(sender=PoolEvent, event=row)

        transaction.on_commit(send)
