"""Admission strategies: where a waiting entry stands in a pool's line.

Every pool's line is read in one order, ``(line_round, line_at, entry)`` (the
``pools_demand_line`` index), and each strategy is a rule for the two columns, set when a
demand row joins the line (enqueue, or a delayed entry becoming due):

=============================  =============================  =============================
strategy                       ``line_round``                 ``line_at``
=============================  =============================  =============================
``priority``                   ``-priority``                  ``enqueued_at``
``priority`` + aging *N*       ``0``                          ``enqueued_at - priority*N s``
``fifo``                       ``0``                          ``enqueued_at``
``lifo``                       ``-enqueued_at`` (µs)          ``enqueued_at``
``fair``                       the key's round                ``enqueued_at``
=============================  =============================  =============================

So a strategy changes only the order: the admission pass (head of line, multi-pool heads,
no oversubscription) is the same for all, and finding the head stays one index range scan.

Aging: ``line_at = enqueued_at - priority * aging_seconds`` orders entries by
``priority + seconds_waited / aging_seconds`` (the *effective priority*), for every clock
reading at once, so the order needs no re-sorting as time passes. No cap: a cap would make
the order depend on the clock.

Fair: rounds per fairness key. A new entry of key *k* gets round
``max(pool.fair_round, last round of k + 1)``, where the last round of *k* counts its
waiting, held and finished entries (``pools_demand_fair_key``: one index probe), and
``pool.fair_round`` is the highest round admitted so far. Within a round, entries go by
``enqueued_at``; so every key gets one admission per round, FIFO within a key.

The fast path (the enqueue function) computes the same columns in SQL; a delayed entry in
a ``fair`` pool gets its round when it becomes due, on the Python path.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

from pools.models import Demand, Pool, QueueEntry, Strategy
from pools.states import DELAYED, FAIR_STATES, EntryState

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICRO = timedelta(microseconds=1)


def micros(when: datetime) -> int:
    """Microseconds since the Unix epoch (what the enqueue function computes for ``lifo``)."""
    return (when - EPOCH) // _MICRO


def aging_of(pool: Pool) -> int | None:
    """Seconds per priority level of aging, when the pool ages its entries."""
    if pool.strategy == Strategy.PRIORITY and pool.aging_seconds is not None:
        return int(pool.aging_seconds)
    return None


def next_round(pool: Pool, key: str) -> int:
    """The round of the next entry of ``key`` in a ``fair`` pool (one index probe)."""
    last = (
        Demand.objects.filter(pool_id=pool.pk, fairness_key=key, state__in=FAIR_STATES)
        .order_by("-line_round")
        .values_list("line_round", flat=True)
        .first()
    )
    return max(pool.fair_round, (last or 0) + 1)


def place(
    pool: Pool, *, priority: int, at: datetime, key: str, delayed: bool = False
) -> tuple[int, datetime, str | None]:
    """``(line_round, line_at, fairness_key)`` of a row joining ``pool``'s line at ``at``.

    A delayed row in a ``fair`` pool gets round 0 until it is due (:func:`join_rounds`).
    """
    if pool.strategy == Strategy.FAIR:
        return (0 if delayed else next_round(pool, key)), at, key
    if pool.strategy == Strategy.FIFO:
        return 0, at, None
    if pool.strategy == Strategy.LIFO:
        return -micros(at), at, None
    aging = aging_of(pool)
    if aging:
        return 0, at - timedelta(seconds=priority * aging), None
    return -priority, at, None


def join_rounds(pools: dict[str, Pool], entry_ids: Iterable[int]) -> None:
    """Rounds for rows of due entries that just joined the lines of ``fair`` pools.

    In the order the entries became due (then queue id), each as a new enqueue would get.
    """
    fair = {p.pk: p for p in pools.values() if p.strategy == Strategy.FAIR}
    if not fair:
        return
    rows = (
        Demand.objects.filter(entry_id__in=list(entry_ids), pool_id__in=list(fair))
        .filter(state=EntryState.WAITING)
        .order_by("enqueued_at", "entry_id", "pool_id")
    )
    for row in rows:
        key = row.fairness_key or ""
        round_ = next_round(fair[row.pool_id], key)
        Demand.objects.filter(pk=row.pk).update(line_round=round_, fairness_key=key)


def note_admitted(pool: Pool, line_round: int) -> None:
    """A ``fair`` pool admitted an entry of this round (caller holds the pool's lock)."""
    if pool.strategy == Strategy.FAIR and line_round > pool.fair_round:
        Pool.objects.filter(pk=pool.pk).update(fair_round=line_round)
        pool.fair_round = line_round


def rerank(pool: Pool) -> int:
    """Give the waiting and delayed rows of ``pool`` their places under its current strategy.

    After a change of ``strategy`` or ``aging_seconds``, under the pool's lock: the waiting
    entries keep their relative enqueue order and take the new rule (a ``fair`` pool deals
    out rounds per key from where each key stands). Costs one pass over the pool's backlog
    (a configuration change, not admission). Returns the number of rows changed.
    """
    rows = list(
        Demand.objects.filter(pool_id=pool.pk, state__in=(EntryState.WAITING, DELAYED))
        .select_related(None)
        .order_by("enqueued_at", "entry_id")
    )
    if not rows:
        return 0
    keys = dict(
        QueueEntry.objects.filter(pk__in=[r.entry_id for r in rows]).values_list(
            "queue_id", "fairness_key"
        )
    )
    # Out of the key index first, so a key's next round counts only its other rows.
    Demand.objects.filter(pk__in=[r.pk for r in rows]).update(fairness_key=None)
    rounds: dict[str, int] = {}
    for row in rows:
        key = keys.get(row.entry_id) or ""
        delayed = row.state == DELAYED
        if pool.strategy == Strategy.FAIR and not delayed:
            if key not in rounds:
                rounds[key] = next_round(pool, key)
            else:
                rounds[key] += 1
            row.line_round, row.line_at, row.fairness_key = rounds[key], row.enqueued_at, key
        else:
            row.line_round, row.line_at, row.fairness_key = place(
                pool, priority=row.priority, at=row.enqueued_at, key=key, delayed=delayed
            )
    Demand.objects.bulk_update(rows, ["line_round", "line_at", "fairness_key"], batch_size=500)
    return len(rows)
