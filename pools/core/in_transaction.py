"""Enqueue inside a caller's transaction: no pool lock until the caller commits.

An enqueue inside the caller's ``atomic()`` (every view under ``ATOMIC_REQUESTS``) would
hold the pool row lock until the caller commits, and every other enqueue, settle and
admission pass of the pool would wait for it. Instead it writes its entry and line rows
without the lock, out of line (``delayed``, due at the time of the call), and admission
runs after the caller commits. Refusals are decided at the call without locks, from the
committed state (docs/concepts/admission.md#calls-inside-a-transaction).
"""

from __future__ import annotations

import logging
from datetime import datetime

from django.db import connection, transaction
from django.db.models import Exists, OuterRef, Q

from pools.core import events
from pools.core.admission_pass import note_due
from pools.core.enqueueing import NeedsLocks, create_entry, demand_rows, refuse
from pools.core.locking import locked_pools, parent_rows_unlocked, unavailable_on_error
from pools.core.pass_runs import admit
from pools.core.records import Enqueued, Submission
from pools.core.supersession import supersedes
from pools.exceptions import PoolUnavailable, UnknownPool
from pools.models import Demand, Pool, QueueEntry
from pools.states import HELD_STATES, EventKind

logger = logging.getLogger("pools.core.admission")


def in_callers_transaction() -> bool:
    """True inside an ``atomic()`` block of the caller on PostgreSQL or MariaDB/MySQL.

    Not inside the blocks Django's ``TestCase`` wraps each test in (they never commit).
    On SQLite an ``IMMEDIATE`` transaction holds the database's write lock from its start:
    there the enqueue keeps the locked path.
    """
    if connection.vendor not in ("postgresql", "mysql") or not connection.in_atomic_block:
        return False
    return any(not getattr(block, "_from_testcase", False) for block in connection.atomic_blocks)


def enqueue_in_callers_transaction(
    sub: Submission, now: datetime, deadline: datetime | None
) -> Enqueued | None:
    """:func:`enqueue` inside the caller's transaction, without pool locks.

    The refusals are checked against the pools' committed rows (no lock); the entry and
    its line rows are written in the caller's transaction, ``delayed`` until the time of
    the call, so no other process sees them before the caller commits and nothing is left
    if it rolls back. No pool row is locked before the commit: PostgreSQL checks the line
    rows' foreign keys when the caller commits, and on MariaDB/MySQL they are not checked
    at the insert (:func:`_insert_line_rows`). After the commit
    :func:`admit_after_commit` puts the entry in line and runs admission.

    ``None`` (nothing written) when the submit needs the locks: it ends other entries (a
    ``replace`` job, a beat fire, a full pool's overflow drop); the caller then takes the
    locked path.
    """
    spec = sub.spec
    if supersedes(sub):
        return None
    names = sorted(spec.demand)
    with unavailable_on_error(f"pools {', '.join(names)}"), transaction.atomic():
        pools = {p.name: p for p in Pool.objects.filter(name__in=names)}
        try:
            refuse(spec.demand, pools, now, drop=False)
        except NeedsLocks:
            return None
        if sub.attempt and sub.idempotency_key is not None:
            QueueEntry.objects.filter(
                key=sub.key, idempotency_key=sub.idempotency_key, state__in=HELD_STATES
            ).update(idempotency_key=None)
        entry = create_entry(sub, now, deadline)
        joins = sub.not_before if sub.not_before and sub.not_before > now else now
        _insert_line_rows(demand_rows(sub, entry, pools, joins, delayed=True))
        events.transition(EventKind.ENQUEUED, [entry], at=now)
    # robust: an unexpected error is logged, never raised out of the caller's commit.
    transaction.on_commit(lambda: admit_after_commit(names, joins), robust=True)
    return Enqueued(entry_id=entry.queue_id, key=entry.key, admitted=False)


def _insert_line_rows(rows: list[Demand]) -> None:
    """Insert an entry's line rows in the caller's transaction without locking their pools.

    On MariaDB/MySQL a checked foreign key would hold a shared lock on each pool row until
    the caller commits (:func:`~pools.core.locking.parent_rows_unlocked`); the pools are
    read again after the insert instead (READ COMMITTED: the latest committed rows), and a
    pool deleted meanwhile is refused as unknown. From then on the uncommitted rows keep
    the pool from being deleted, as a checked key would.
    """
    with parent_rows_unlocked():
        Demand.objects.bulk_create(rows)
    if connection.vendor == "mysql":
        ids = {row.pool_id: row.pool.name for row in rows}
        found = set(Pool.objects.filter(pk__in=list(ids)).values_list("pk", flat=True))
        missing = sorted(name for pk, name in ids.items() if pk not in found)
        if missing:
            raise UnknownPool(missing[0])


def admit_after_commit(names: list[str], due: datetime) -> None:
    """After the caller committed: the entry is due at ``due``; admission runs now.

    Two short transactions: the pools' ``next_due_at`` is brought forward under their
    locks, then an ordinary admission pass (:func:`admit`) puts the entry in line and
    admits what fits. Never raises into the caller's commit: if the pools cannot be
    locked now, the sweep's :func:`note_due_entries` finds the entry and admits it.
    """
    try:
        with locked_pools(names) as pools:
            note_due(pools, [n for n in names if n in pools], due)
        admit(names)
    except PoolUnavailable as exc:
        logger.warning(
            "Admission after commit of an entry of pools %s deferred to the sweep: %s",
            ", ".join(names),
            exc,
        )


def note_due_entries() -> int:
    """Pools with delayed line rows due before their ``next_due_at`` get it corrected.

    Admission looks at a pool's delayed rows only from its ``next_due_at``, which an
    enqueue inside a caller's transaction sets after the commit: a process that died
    between its commit and that moment leaves rows no pass would look at. The sweep
    calls this: one query, an index probe per pool (``pools_demand_delayed``), and a lock
    only for a pool that needs it. Returns how many pools were corrected.
    """
    delayed = Demand.objects.delayed().filter(pool_id=OuterRef("pk"))
    suspects = list(
        Pool.objects.filter(
            Q(Exists(delayed), next_due_at__isnull=True)
            | Q(Exists(delayed.filter(enqueued_at__lt=OuterRef("next_due_at"))))
        ).values_list("name", flat=True)
    )
    for name in suspects:
        with locked_pools([name]) as pools:
            if name in pools:
                first = (
                    Demand.objects.delayed()
                    .filter(pool_id=pools[name].pk)
                    .order_by("enqueued_at")
                    .values_list("enqueued_at", flat=True)
                    .first()
                )
                if first is not None:
                    note_due(pools, [name], first)
    return len(suspects)
