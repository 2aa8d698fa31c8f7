"""Held-slot counters: each pool's ``held`` and ``admissions`` columns, changed under its lock.

Every change to the holders of a pool (admit, settle, requeue) moves the counter in the
same transaction, with the pool's row lock held (:mod:`pools.core.locking`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db import connection
from django.db.models import Case, F, Value, When

from pools.models import OwedWork, Pool, QueueEntry


def held_by_pool(pools: dict[int, Pool]) -> dict[int, int]:
    """Slots held in each (locked) pool: its ``held`` counter, read with the lock."""
    return {pid: pool.held for pid, pool in pools.items()}


#: Take the owed work of the locked pools (one statement): zero their pending owed-work rows
#: that no call is writing now (``SKIP LOCKED``: such a call looks again after its commit)
#: and subtract each pool's owed slots from its ``held``; returns the pools whose counter
#: moved and its new value. The same take as ``pools_admit`` in ``pools/pg/sql/schema.sql``.
_TAKE_OWED = (
    "WITH t AS (SELECT o.id, o.pool_id, o.slots FROM {owed} o"
    " WHERE o.pool_id = ANY(%s) AND o.pending FOR NO KEY UPDATE SKIP LOCKED),"
    " u AS (UPDATE {owed} o SET slots = 0, pending = false FROM t WHERE o.id = t.id"
    " RETURNING t.pool_id, t.slots) "
    "UPDATE {pool} p SET held = p.held - s.n "
    "FROM (SELECT pool_id, sum(slots) AS n FROM u GROUP BY pool_id) s "
    "WHERE p.id = s.pool_id AND s.n > 0 RETURNING p.id, p.held"
)


def apply_owed(pools: Iterable[Pool]) -> None:
    """Take the work calls that found these pools locked left to their lock holder.

    On PostgreSQL a settle or enqueue outside a transaction that finds its pool's row
    locked does not wait: it leaves :class:`~pools.models.OwedWork` (slots > 0: a
    release of held slots; 0: an owed admission pass) for the holder. The caller holds the
    pools' row locks and is about to run an admission pass over them: the pending rows are
    zeroed (the pass is the owed admission pass) and their slots subtracted from ``held``,
    in the database and in the in-memory rows, so the pass admits with the slots already
    released. The same as ``pools_admit`` does in ``pools/pg/sql/schema.sql``; work left
    after this statement waits for the holder's look after its commit
    (docs/concepts/admission.md#contention). One statement; nothing on other databases
    (they never write owed rows).
    """
    locked = {p.pk: p for p in pools}
    if not locked or connection.vendor != "postgresql":
        return
    sql = _TAKE_OWED.format(owed=OwedWork._meta.db_table, pool=Pool._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(sql, [list(locked)])
        for pk, held in cursor.fetchall():
            locked[pk].held = held


def change_held(
    pools: dict[str, Pool], entries: Iterable[QueueEntry], sign: int, *, admitted: bool = False
) -> dict[int, int]:
    """Add (``sign`` +1) or release (-1) the entries' slots in the locked pools' counters.

    One UPDATE, in the transaction that changes the holders, with the row locks held; the
    in-memory rows follow, so a pass later in the same transaction reads the new value.
    With ``admitted=True`` the entries were just admitted, in this order: each pool's
    ``admissions`` count goes up by its entries, and the result maps each entry id to its
    ``admission_seq`` (the count of its first pool by name after it).
    """
    changes: dict[str, int] = {}
    counted: dict[str, int] = {}
    seq: dict[int, int] = {}
    for entry in entries:
        for name in sorted(entry.demand):
            if name not in pools:
                continue
            changes[name] = changes.get(name, 0) + sign * entry.demand[name]
            if admitted:
                counted[name] = counted.get(name, 0) + 1
                seq.setdefault(entry.queue_id, pools[name].admissions + counted[name])
    changed = {name for name, n in changes.items() if n} | set(counted)
    if not changed:
        return seq
    ids = {name: pools[name].pk for name in changed}
    update: dict[str, Any] = {
        "held": F("held")
        + Case(
            *(When(pk=ids[name], then=Value(changes.get(name, 0))) for name in changed),
            default=Value(0),
        )
    }
    if counted:
        update["admissions"] = F("admissions") + Case(
            *(When(pk=ids[name], then=Value(n)) for name, n in counted.items()),
            default=Value(0),
        )
    Pool.objects.filter(pk__in=list(ids.values())).update(**update)
    for name in changed:
        pools[name].held += changes.get(name, 0)
        pools[name].admissions += counted.get(name, 0)
    return seq


# --------------------------------------------------------------------------- admission pass
