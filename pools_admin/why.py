"""Adapter to :mod:`pools.core.explain`: "why is it waiting" for many entries in a fixed number of queries.

:func:`pools.core.explain.explain` costs three queries plus two per pool for *one* entry; a
page listing the tasks of a run would pay that per task. :func:`explain_entries` reads
what the decision needs once per pool (holders, recent hold times, the head of the line,
the positions of the listed entries) and then calls the same :func:`pools.core.explain.decide`
for every waiting entry, so the answer is the one the REST API gives, at a cost of
``2 + 3 x pools`` queries whatever the number of entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from pools.core import explain as core
from pools.core import line_places
from pools.models import Demand, Pool, QueueEntry
from pools.states import EntryState


def explain_entries(
    entries: Sequence[QueueEntry], pools: dict[str, Pool], now: datetime
) -> dict[int, core.Explanation]:
    """Explanations of the *waiting* ones among ``entries`` (by queue id).

    ``pools`` must hold every pool they name (by name). Entries that are not waiting are
    left out: their state, worker and lease say where they are.
    """
    waiting = [e for e in entries if e.state == EntryState.WAITING]
    out: dict[int, core.Explanation] = {}
    if not waiting:
        return out
    names = sorted({name for e in waiting for name in e.demand if name in pools})
    pool_ids = [pools[n].pk for n in names]
    holders = core.held_rows(pool_ids)
    holds = line_places.hold_times(pool_ids, now)
    positions: dict[str, dict[int, int]] = {}
    heads: dict[str, Demand | None] = {}
    for name in names:
        pool = pools[name]
        members = [e for e in waiting if name in e.demand]
        positions[name] = line_places.positions(pool, members)
        heads[name] = Demand.objects.line(pool.pk).select_related("entry").first()
    for e in waiting:
        places = []
        for name in sorted(e.demand):
            if name not in pools:
                continue
            pool = pools[name]
            view = core.PoolView(pool=pool, holders=holders[pool.pk], holds=holds.get(pool.pk, ()))
            delayed = e.not_before is not None and e.not_before > now
            position = None if delayed else positions[name].get(e.queue_id)
            head = heads[name] if position is not None and position > 1 else None
            places.append(core.decide(view, e, int(e.demand[name]), position, head, now))
        out[e.queue_id] = core.Explanation(entry=e, places=core.mark_blocked_by_other_pool(places))
    return out


def explain_one(entry: QueueEntry, *, now: datetime | None = None) -> core.Explanation:
    """The core's own answer for one entry (the entry admin's detail page)."""
    return core.explain(entry, now=now)
