"""One pool's entries in one state, a page at a time (``GET pools/<name>/entries``).

Read-only, no locks. A page of waiting entries is in line order, each with its position
and its reason to wait (as the pool views of :mod:`pools.core.snapshots` explain them);
other states are in entry order. The cursor is opaque: it names the state and the last
row of the page before.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db.models import Q
from django.utils import timezone

from pools.core import explain, line_places
from pools.core.explain import PoolView
from pools.core.snapshots import Gate, LineItem, explained_items, item, other_gates, view_rows
from pools.exceptions import UnknownPool
from pools.models import Demand, Pool
from pools.querysets import LINE_ORDER
from pools.states import HELD_STATES, EntryState

#: Largest page of :func:`entries_page`.
MAX_PAGE = 500


class InvalidCursor(ValueError):
    """A paging cursor that was not produced by :func:`entries_page` for this line."""


@dataclass(frozen=True, kw_only=True)
class Page:
    """One page of a pool's entries in one state."""

    items: list[LineItem]
    #: Opaque cursor of the next page; ``None`` on the last page.
    next_cursor: str | None


#: Demand states a page can list (``delayed``: not due yet, when the engine has it).
PAGE_STATES = (*(s.value for s in EntryState), "delayed")


def _encode(values: list[Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(values).encode()).decode().rstrip("=")


def _decode(cursor: str, state: str) -> list[Any]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        values = json.loads(raw)
    except (binascii.Error, ValueError) as exc:
        raise InvalidCursor(f"Invalid cursor {cursor!r}: use the next cursor of a page.") from exc
    if not isinstance(values, list) or not values or values[0] != state:
        raise InvalidCursor(f"Cursor {cursor!r} is not for state {state!r}.")
    return values[1:]


def entries_page(
    name: str, *, state: str = "waiting", cursor: str | None = None, limit: int = 50
) -> Page:
    """One page of pool ``name``'s entries in ``state``; at most 7 queries.

    Waiting entries come in line order with their positions and why each waits; other
    states in queue-id order. Pass ``next_cursor`` back as ``cursor`` for the next page.
    Raises :class:`UnknownPool`, or :class:`InvalidCursor` (also for an unknown state).
    """
    if state not in PAGE_STATES:
        raise InvalidCursor(f"Unknown state {state!r}; use one of {', '.join(PAGE_STATES)}.")
    limit = max(1, min(int(limit), MAX_PAGE))
    pool = Pool.objects.filter(name=name).first()
    if pool is None:
        raise UnknownPool(name)
    after = _decode(cursor, state) if cursor else None
    now = timezone.now()
    if state in HELD_STATES:  # held rows stay "admitted" while running: ask the entry
        base = Demand.objects.filter(pool_id=pool.pk, state__in=HELD_STATES, entry__state=state)
    else:
        base = Demand.objects.filter(pool_id=pool.pk, state=state)
    if state == EntryState.WAITING:
        qs = base.order_by(*LINE_ORDER)
        if after:
            try:
                p, t, i = int(after[0]), datetime.fromisoformat(after[1]), int(after[2])
            except (ValueError, TypeError, IndexError) as exc:
                raise InvalidCursor(f"Invalid cursor {cursor!r}.") from exc
            qs = qs.filter(
                Q(line_round__gt=p)
                | Q(line_round=p, line_at__gt=t)
                | Q(line_round=p, line_at=t, entry_id__gt=i)
            )
        rows = list(view_rows(qs)[: limit + 1])
        more = len(rows) > limit
        rows = rows[:limit]
        first = rows[0] if rows and not after else view_rows(Demand.objects.line(pool.pk)).first()
        start = line_places.position_of(rows[0]) if rows and after else 1
        view = PoolView(
            pool=pool,
            holders=explain.held_rows([pool.pk])[pool.pk],
            holds=line_places.hold_times([pool.pk], now).get(pool.pk, ()),
        )
        gates = {
            pool.name: Gate(
                name=pool.name,
                paused=pool.paused,
                free=view.free,
                first=first.entry_id if first else None,
            )
        }
        if any(len(d.entry.demand) > 1 for d in rows):
            gates = other_gates({n for d in rows for n in d.entry.demand}, gates)
        items = explained_items(
            view, [(d, start + i) for i, d in enumerate(rows)], first, gates, now
        )
        last = rows[-1] if rows else None
        next_cursor = (
            _encode([state, last.line_round, last.line_at.isoformat(), last.entry_id])
            if more and last
            else None
        )
        return Page(items=items, next_cursor=next_cursor)
    qs = base.order_by("entry_id")
    if after:
        try:
            qs = qs.filter(entry_id__gt=int(after[0]))
        except (ValueError, TypeError) as exc:
            raise InvalidCursor(f"Invalid cursor {cursor!r}.") from exc
    rows = list(view_rows(qs)[: limit + 1])
    more = len(rows) > limit
    rows = rows[:limit]
    next_cursor = _encode([state, rows[-1].entry_id]) if more and rows else None
    return Page(items=[item(d) for d in rows], next_cursor=next_cursor)
