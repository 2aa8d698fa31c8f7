"""The admission engine: the operations whose implementation depends on the database.

Two engines implement :class:`Engine`: the ORM engine (:mod:`pools.core.engines.orm`,
every database) and the PostgreSQL engine (:mod:`pools.pg.engine`, stored functions: one
round trip per enqueue, start and settle). :func:`engine` picks one per database
connection; callers (:mod:`pools.core.admission`, :mod:`pools.core.leases`, the Celery
worker, the system checks) never ask which. What the PostgreSQL engine hands to the ORM
engine is one rule, :func:`pools.pg.engine.handed_to_orm` (docs/concepts/contract.md).

Renew, cancel and expire are the same on both engines (single-row updates, or rare
operations under the pools' locks) and are not part of the interface.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Protocol

from django.db import connection

from pools import conf
from pools.core.engines.orm import ORM
from pools.core.records import Admission, Claim, Enqueued, Submission
from pools.pg import engine as pg_engine
from pools.pg import fastpath


class Engine(Protocol):
    """The operations of ``docs/concepts/contract.md`` that an engine implements."""

    #: ``orm`` or ``postgresql``.
    name: str
    #: Workers start and settle on pools' own connection (which Celery never closes).
    own_worker_connection: bool

    def enqueue(
        self, sub: Submission, now: datetime, deadline: datetime | None, *, budgeted: bool
    ) -> Enqueued:
        """Put a submit in line (locks, refusals, idempotency) and admit what fits."""
        ...

    def start(self, entry_id: int, token: int, *, worker: str) -> Claim | None:
        """Mark an admitted entry running; None for a stale token or a pinned entry."""
        ...

    def settle(
        self, entry_id: int, token: int, outcome: str, *, reason: str, live_lease: bool
    ) -> bool:
        """Finish a held attempt once per token, then admit the next entries."""
        ...

    def requeue(
        self,
        entry_id: int,
        token: int,
        *,
        reason: str,
        admit: bool,
        lapsed_before: datetime | None,
        unstarted: bool,
    ) -> bool:
        """Put a held entry back in line (or expire it); False for a stale token."""
        ...

    def admit(self, names: Iterable[str]) -> list[Admission]:
        """Run an admission pass over the named pools."""
        ...


def choose() -> Engine:
    """The engine for the default connection as configured now (no cache)."""
    return pg_engine.POSTGRESQL if fastpath.enabled() else ORM


def engine() -> Engine:
    """The engine of the default database connection, chosen once per connection.

    The choice (vendor and ``POOLS["SQL_FAST_PATH"]``) is kept on the connection object
    and made again only when the settings are reloaded (``override_settings``).
    """
    settings = conf.get()
    kept = getattr(connection, "_pools_engine", None)
    if kept is not None and kept[0] is settings:
        chosen: Engine = kept[1]
        return chosen
    chosen = choose()
    connection._pools_engine = (settings, chosen)  # type: ignore[attr-defined]
    return chosen
