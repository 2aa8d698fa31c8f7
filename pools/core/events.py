"""The append-only event log, and the Django signals sent for each event after commit.

The normal transitions of an entry (enqueued, admitted, started, settled) are not written
to the log: the entry carries their times (``enqueued_at``, ``admitted_at``, ``started_at``,
``finished_at``), its token, worker and reason, and :func:`stream` reads them back as
events, merged with the logged rows of the rare transitions (requeued, expired, cancelled,
rejected, skipped deliveries) and of configuration changes. Their signals are sent all the
same (:func:`transition`), with an unsaved :class:`~pools.models.PoolEvent` (``id`` None).

Both admission paths go through :func:`announce`: the ORM path with the rows it has just
built, the stored functions with the rows they return. Signals are sent only when
the transaction that wrote the rows commits (``transaction.on_commit``), in the order
the rows were written, and never for work that was rolled back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from django.db import transaction

from pools import signals
from pools.models import PoolEvent, QueueEntry
from pools.states import EventKind

#: Transitions the entry row records itself (no event row); see the module docstring.
NOT_LOGGED = frozenset(
    {EventKind.ENQUEUED, EventKind.ADMITTED, EventKind.STARTED, EventKind.SETTLED}
)


def record(
    kind: EventKind,
    entries: Iterable[QueueEntry],
    *,
    at: datetime,
    detail: dict[str, Any] | None = None,
    actor: str | None = None,
) -> None:
    """Append one event per (entry, pool) pair and send the matching signal on commit.

    ``actor`` is the user who asked for the change (admin, REST API), if any.
    """
    save_rows(kind, _per_pool(kind, entries, at, detail, actor))


def _per_pool(
    kind: str,
    entries: Iterable[QueueEntry],
    at: datetime,
    detail: dict[str, Any] | None,
    actor: str | None = None,
) -> list[PoolEvent]:
    """One (unsaved) event per (entry, pool) pair."""
    return [
        PoolEvent(
            at=at,
            kind=kind,
            pool=pool,
            entry_id=entry.queue_id,
            key=entry.key,
            token=entry.token,
            detail={"slots": slots, **(detail or {})},
            actor=actor or "",
        )
        for entry in entries
        for pool, slots in entry.demand.items()
    ]


def transition(
    kind: str,
    entries: Iterable[QueueEntry],
    *,
    at: datetime,
    detail: dict[str, Any] | None = None,
) -> None:
    """A normal transition (:data:`NOT_LOGGED`): its signal on commit, no event row.

    One unsaved event per (entry, pool) pair, as :func:`record` would have written.
    """
    signal = signals.BY_KIND.get(kind)
    if signal is None or not signal.has_listeners(PoolEvent):
        return
    announce(_per_pool(kind, entries, at, detail))


_ENDS_WAITING = frozenset(
    {EventKind.EXPIRED, EventKind.CANCELLED, EventKind.REJECTED, EventKind.SUPERSEDED}
)


#: Order of events at one instant: an entry is enqueued before it is admitted, a slot is
#: released (settle, requeue, an entry ending while waiting) before the pass that reuses it.
_RANK: dict[str, int] = {
    EventKind.ENQUEUED: 0,
    EventKind.SETTLED: 1,
    EventKind.ADMITTED: 2,
    EventKind.STARTED: 3,
}
_LOGGED_RANK = 1


def stream(entries: Iterable[QueueEntry], logged: Iterable[PoolEvent]) -> list[PoolEvent]:
    """The events of ``entries`` as one stream, in the order they happened.

    The normal transitions are read from each entry's times (for an entry whose claim
    was requeued, the last admission, start and settle are those it carries; the requeues
    themselves are logged rows), merged with ``logged`` (rows of the event log). Events
    read from entries have no ``id``. At one instant: enqueued, then releases (settled and
    logged rows, by id), then admissions (by entry), then starts.

    Each time is its call's clock, read before the call waited for the pools' locks (the
    stored functions' ``p_now``, the Python pass's ``now``): an admission that waited
    behind the requeue it follows can carry an earlier time than that requeue. Within
    one entry the tokens give the true order (a requeue logs the token it took back, an
    admission grants the next one).
    """
    out: list[tuple[datetime, int, int, int, PoolEvent]] = []
    ended_waiting = set()  # entries that ended while waiting: their end is a logged row
    for row in logged:
        out.append((row.at, _LOGGED_RANK, 0, row.id or 0, row))
        if row.kind in _ENDS_WAITING:
            ended_waiting.add(row.entry_id)
    for e in entries:
        steps: list[tuple[str, datetime | None, dict[str, Any]]] = [
            (EventKind.ENQUEUED, e.enqueued_at, {}),
            (EventKind.ADMITTED, e.admitted_at, {}),
            (EventKind.STARTED, e.started_at, {"worker": e.worker}),
        ]
        if e.finished_at is not None and e.admitted_at and e.queue_id not in ended_waiting:
            steps.append((EventKind.SETTLED, e.finished_at, {"outcome": e.state}))
        for kind, at, detail in steps:
            if at is None:
                continue
            for index, (pool, slots) in enumerate(e.demand.items()):
                event = PoolEvent(
                    at=at,
                    kind=kind,
                    pool=pool,
                    entry_id=e.queue_id,
                    key=e.key,
                    token=0 if kind == EventKind.ENQUEUED else e.token,
                    detail={"slots": slots, **detail},
                )
                out.append((at, _RANK[kind], e.queue_id, index, event))
    out.sort(key=lambda item: item[:4])
    return [item[4] for item in out]


def record_pool(
    kind: EventKind,
    pool: str,
    *,
    at: datetime,
    detail: dict[str, Any],
    actor: str | None = None,
) -> None:
    """Append one pool-level event (created, capacity changed, paused, deleted).

    ``actor`` is the user who made the change (admin, REST API), if any.
    """
    save_rows(kind, [PoolEvent(at=at, kind=kind, pool=pool, detail=detail, actor=actor or "")])


def save_rows(kind: EventKind, rows: list[PoolEvent]) -> None:
    """Insert event rows (all of ``kind``) and send their signal after commit."""
    if not rows:
        return
    PoolEvent.objects.bulk_create(rows)
    announce(rows)


def announce(rows: Sequence[PoolEvent], *, committed: bool = False) -> None:
    """Send each row's lifecycle signal when the current transaction commits, in order.

    Rows of kinds nobody listens to cost nothing. Inside a savepoint that is rolled
    back, Django drops the callback: no signal for rolled-back work. ``committed=True``
    (the rows' transaction has committed on another connection) sends them now.
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

    if committed:
        send()
    else:
        transaction.on_commit(send)
