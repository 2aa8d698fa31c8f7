"""The PostgreSQL fast path: when it applies, how its stored functions are called, and
the one place their rows are decoded.

Enqueue, settle+admit and start each run as one call of a function created by migration
0006 (``pools/pg/sql/admission_v3.sql``): one round trip, so a pool's row lock is held for
the time the database needs, not for a dozen client round trips. The functions implement
the contract of ``docs/concepts/contract.md`` like :mod:`pools.core.admission` does, and hand
anything unusual (multi-pool heads, deadlines, due multi-pool entries) back to it. They
are used when the database is PostgreSQL and ``POOLS["SQL_FAST_PATH"]`` is true (the
default). Connected signal receivers do not change the path: the functions then also
return the event rows they wrote, and the caller sends the signals after commit.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import DatabaseError, IntegrityError, ProgrammingError, connection, transaction

from pools import conf, signals
from pools.core.locking import BOUND, bound_params, unavailable
from pools.models import PoolEvent


def enabled() -> bool:
    """True when enqueue, settle and start run as stored-function calls."""
    return connection.vendor == "postgresql" and conf.get().SQL_FAST_PATH


def listening() -> bool:
    """True when some lifecycle signal has a receiver (the functions then return events)."""
    return any(signal.has_listeners(PoolEvent) for signal in signals.BY_KIND.values())


@dataclass(frozen=True, kw_only=True)
class Row:
    """One row of a v3 function (``pools_out_v3``): each column has one meaning.

    ``kind`` says which columns are set (see the comment above ``pools_out_v3``).
    """

    #: refused, enqueued, settled, started, admitted, fallback, wake or event.
    kind: str
    entry: int | None = None
    key: str | None = None
    token: int | None = None
    pool: str | None = None
    task: str | None = None
    args: Any = None
    kwargs: Any = None
    options: Any = None
    demand: dict[str, int] | None = None
    #: The state a settled entry ended in.
    state: str | None = None
    #: Why an enqueue was refused: ``unknown``, ``capacity`` or ``full``.
    reason: str | None = None
    #: Slots asked of the refusing pool.
    asked: int | None = None
    #: The refusing pool's capacity (``capacity``) or ``max_queued`` (``full``).
    limit: int | None = None
    #: Lease end (started), due time (wake) or event time (event).
    at: datetime | None = None
    event: int | None = None
    event_kind: str | None = None
    detail: dict[str, Any] | None = None


_JSON = {"args", "kwargs", "options", "demand", "detail"}
_NAMES = {f.name for f in fields(Row)}


@dataclass(frozen=True)
class Reply:
    """The decoded rows of one function call."""

    rows: list[Row]

    def of(self, kind: str) -> list[Row]:
        """The rows of one kind, in the order the function returned them."""
        return [r for r in self.rows if r.kind == kind]

    def first(self, kind: str) -> Row | None:
        """The first row of ``kind``, if any."""
        return next((r for r in self.rows if r.kind == kind), None)

    @property
    def fallbacks(self) -> set[str]:
        """Pools whose head the function left to the full pass."""
        return {r.pool for r in self.of("fallback") if r.pool}

    @property
    def wake(self) -> dict[str, datetime]:
        """Pools with a delayed entry due later: when to run admission again."""
        return {r.pool: r.at for r in self.of("wake") if r.pool and r.at}

    @property
    def events(self) -> list[PoolEvent]:
        """The event rows the call wrote (only when it was asked to return them), by id."""
        return [
            PoolEvent(
                id=r.event,
                at=r.at or datetime.min,
                kind=r.event_kind or "",
                pool=r.pool or "",
                entry_id=r.entry,
                key=r.key or "",
                token=r.token,
                detail=r.detail or {},
            )
            for r in sorted(self.of("event"), key=lambda r: r.event or 0)
        ]


def decode(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Reply:
    """Rows of a v3 function as :class:`Row` objects, by column name (``o_`` dropped)."""
    names = [c[2:] if c.startswith("o_") else c for c in columns]
    unknown = set(names) - _NAMES
    if unknown:  # pragma: no cover - a function and this module disagree
        raise ProgrammingError(f"unexpected fast-path columns: {sorted(unknown)}")
    decoded = []
    for values in rows:
        data = dict(zip(names, values, strict=True))
        for name in _JSON & data.keys():
            data[name] = json_value(data[name])
        decoded.append(Row(**data))
    return Reply(decoded)


def call(function: str, params: Sequence[Any], *, what: str) -> Reply:
    """``SELECT * FROM function(params)`` under the bound; errors become :class:`PoolUnavailable`.

    One query string: ``SET LOCAL`` of ``lock_timeout`` and ``statement_timeout``
    (``LOCK_TIMEOUT_SECONDS``), then the call. Inside a caller's transaction the call gets
    a savepoint, so a timeout does not break the caller's transaction (the bound then
    stays set until that transaction ends, as on the ORM path); in autocommit the query
    string is its own transaction.
    """
    placeholders = ", ".join(["%s"] * len(params))
    guard = transaction.atomic() if connection.in_atomic_block else nullcontext()
    try:
        with guard, connection.cursor() as cursor:
            cursor.execute(
                f"{BOUND}SELECT * FROM {function}({placeholders})", [*bound_params(), *params]
            )
            while cursor.description is None and cursor.nextset():
                pass  # past the SET results
            columns = [c.name for c in cursor.description or ()]
            return decode(columns, cursor.fetchall())
    except (IntegrityError, ProgrammingError):
        raise  # a bug or a missing migration, not an outage: do not disguise it
    except DatabaseError as exc:
        raise unavailable(what, exc) from exc


def jsonb(value: Any) -> str:
    """A parameter for a ``jsonb`` argument, encoded as the model's JSON fields encode it."""
    return json.dumps(value, cls=DjangoJSONEncoder)


def json_value(value: Any) -> Any:
    """A ``jsonb`` column as Python data (drivers may hand it over as text)."""
    return json.loads(value) if isinstance(value, str | bytes) else value
