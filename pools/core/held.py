"""Held-slot counters: each pool's ``held`` and ``admissions`` columns, changed under its lock.

Every change to the holders of a pool (admit, settle, requeue) moves the counter in the
same transaction, with the pool's row lock held (:mod:`pools.core.locking`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db.models import Case, F, Value, When

from pools.models import RELEASING, Demand, Pool, QueueEntry


def held_by_pool(pools: dict[int, Pool]) -> dict[int, int]:
    """Slots held in each (locked) pool: its ``held`` counter, read with the lock."""
    return {pid: pool.held for pid, pool in pools.items()}


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


def release_pending(pools: dict[str, Pool]) -> int:
    """Release the slots of entries that settled while another transaction held these
    (now locked) pools: their ``releasing`` demand rows leave the ``held`` counters and take
    their entry's final state. Returns how many rows were released.

    Run by every holder of pools' row locks right after it takes them
    (:func:`pools.core.locking.locked_pools`), so a pool's ``held`` is exact under its lock.
    One index range scan (``pools_demand_line``) when nothing is owed.
    """
    if not pools:
        return 0
    by_id = {p.pk: p for p in pools.values()}
    rows = list(
        Demand.objects.filter(pool_id__in=list(by_id), state=RELEASING).values_list(
            "pk", "pool_id", "slots", "entry__state"
        )
    )
    if not rows:
        return 0
    changes: dict[str, int] = {}
    by_state: dict[str, list[int]] = {}
    for pk, pool_id, slots, state in rows:
        name = by_id[pool_id].name
        changes[name] = changes.get(name, 0) + slots
        by_state.setdefault(state, []).append(pk)
    Pool.objects.filter(pk__in=[pools[n].pk for n in changes]).update(
        held=F("held")
        - Case(
            *(When(pk=pools[n].pk, then=Value(slots)) for n, slots in changes.items()),
            default=Value(0),
        )
    )
    for name, slots in changes.items():
        pools[name].held -= slots
    for state, pks in by_state.items():
        Demand.objects.filter(pk__in=pks).update(state=state)
    return len(rows)
