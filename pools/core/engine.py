"""The admission engine: the operations whose implementation depends on the database.

Two engines implement :class:`Engine`: the ORM engine (:mod:`pools.core.engines.orm`,
every database) and the PostgreSQL engine (:mod:`pools.pg.engine`, stored functions: one
round trip per enqueue, start and settle). :func:`engine` picks one per database
connection; callers (:mod:`pools.core.admission`, :mod:`pools.core.leases`, the Celery
worker, the system checks) never ask which. What the PostgreSQL engine hands to the ORM
engine is one rule, :func:`pools.pg.engine.handed_to_orm` (docs/concepts/contract.md).
Without the stored functions of this release the ORM engine serves PostgreSQL too.

Renew, cancel and expire are the same on both engines (single-row updates, or rare
operations under the pools' locks) and are not part of the interface.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Protocol

from django.db import DatabaseError, connection

from pools import conf
from pools.core import locking
from pools.core.engines.orm import ORM
from pools.core.records import Admission, Claim, Enqueued, Submission
from pools.pg import engine as pg_engine
from pools.pg import fastpath

if TYPE_CHECKING:
    from pools.core.starts import Postponed

logger = logging.getLogger("pools.engine")


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

    def try_start_rated(
        self, entry_id: int, token: int, *, worker: str
    ) -> Claim | Postponed | None:
        """One check of a rated start (:mod:`pools.core.starts`): start it if its place in
        each of its pools' windows of starts has come, else say when it comes."""
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

    def wake(self, names: Iterable[str]) -> list[Admission]:
        """A timed wake-up's admission pass over ``names``: run now, or left to whoever
        holds those pools' locks (who runs it after their commit)."""
        ...


def configured() -> Engine:
    """The engine the settings and the vendor call for, without reading the database.

    For the system checks, which must not query (``manage.py check`` and ``migrate`` run
    them on a database that may not be migrated yet): a PostgreSQL database without the
    stored functions still gets the ORM engine from :func:`engine` until it is migrated.
    """
    return pg_engine.POSTGRESQL if fastpath.enabled() else ORM


def choose() -> tuple[Engine, bool]:
    """The engine for the default connection as configured now (no cache), and whether
    that choice may be kept for the connection.

    The PostgreSQL engine needs PostgreSQL, ``POOLS["SQL_FAST_PATH"]`` and the stored
    functions at the version this code calls (:data:`pools.pg.functions.VERSION`). When
    the database lacks them (the code was deployed before ``manage.py migrate pools``) the
    ORM engine serves the connection instead, and a warning says so once per process.
    When the catalog cannot be read (the database is unreachable) the PostgreSQL engine is
    returned but not kept: the call itself then reports the outage, as every call does.
    """
    if not fastpath.enabled():
        return ORM, True
    try:
        missing = missing_functions()
    except DatabaseError:
        return pg_engine.POSTGRESQL, False
    if missing:
        _warn_missing(missing)
        return ORM, True
    return pg_engine.POSTGRESQL, True


#: Databases (name, host, port) known to have the stored functions this code calls. Kept
#: for the process: once installed at a version they stay while this code runs (a release
#: drops them one release later, never under the code that calls them).
_installed: set[tuple[str, str, str]] = set()


def missing_functions() -> list[str]:
    """The stored functions this code calls that the default database lacks (PostgreSQL).

    One catalog query the first time per process for a database that has them all (then
    remembered); for one that lacks some, once per database session (a new session, after
    ``migrate`` for instance, reads again). Database errors propagate.
    """
    where = connection.settings_dict
    database = (str(where.get("NAME")), str(where.get("HOST")), str(where.get("PORT")))
    if database in _installed:
        return []
    connection.ensure_connection()
    session = connection.connection
    kept = getattr(connection, "_pools_missing_functions", None)
    if kept is not None and kept[0] is session:
        missing: list[str] = kept[1]
        return missing
    missing = pg_engine.missing_functions()
    if missing:
        connection._pools_missing_functions = (session, missing)  # type: ignore[attr-defined]
    else:
        _installed.add(database)
    return missing


#: The sets of missing functions already warned about (once per process each).
_warned: set[tuple[str, ...]] = set()


def _warn_missing(missing: list[str]) -> None:
    if tuple(missing) in _warned:
        return
    _warned.add(tuple(missing))
    logger.warning(
        "The database %r lacks the stored functions of this release of "
        "django-celery-pools (%s): pooled calls use the ORM engine (correct, slower) "
        "until you run 'manage.py migrate pools'.",
        connection.settings_dict.get("NAME"),
        ", ".join(missing),
    )


def engine() -> Engine:
    """The engine of the default database connection, chosen once per connection.

    The choice (vendor, ``POOLS["SQL_FAST_PATH"]``, the stored functions) is kept on the
    connection object and made again when the settings are reloaded (``override_settings``)
    or, if the ORM engine stands in for missing stored functions, when the connection
    opens a new database session (``migrate`` may have run meanwhile).
    """
    settings = conf.get()
    kept = getattr(connection, "_pools_engine", None)
    if (
        kept is not None
        and kept[0] is settings
        and (kept[1] is None or kept[1] is connection.connection)
    ):
        chosen: Engine = kept[2]
        return chosen
    chosen, keep = choose()
    if keep:
        # Only a stand-in for missing functions is tied to the session it was chosen on.
        standing_in = chosen is ORM and fastpath.enabled()
        session = connection.connection if standing_in else None
        connection._pools_engine = (settings, session, chosen)  # type: ignore[attr-defined]
    return chosen


def _look_again(names: list[str]) -> None:
    """After a commit that held pool locks: on the PostgreSQL engine, admit what calls
    that found those pools locked left to the holder (docs/concepts/admission.md#contention)."""
    if engine() is pg_engine.POSTGRESQL:
        pg_engine.recheck_safely(names)


locking.after_locks(_look_again)
