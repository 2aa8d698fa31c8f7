"""The PostgreSQL fast path: when it applies, how its stored functions are called, and
the one place their rows are decoded.

Enqueue, settle+admit and start each run as one call of a stored function
(``pools/pg/sql/schema.sql``, named by :mod:`pools.pg.functions`): one round trip, so a pool's row lock is held for
the time the database needs, not for a dozen client round trips. The functions implement
the contract of ``docs/concepts/contract.md`` like the ORM engine does, and hand
anything unusual (multi-pool heads, deadlines, due multi-pool entries) back to it. They
are used when the database is PostgreSQL and ``POOLS["SQL_FAST_PATH"]`` is true (the
default). Connected signal receivers do not change the path: the functions then also
return one event row per transition, and the caller sends the signals after commit.

**Pools' own connection.** In a worker process (:func:`use_own_connection`, called at
``worker_process_init``) a call made outside any transaction of Django's connection runs
on a connection of pools' own, opened with Django's connection parameters, kept for the
life of the process (one per thread), in autocommit, with the statement bound set once
per session and each function call a server-side prepared statement (or, with prepared
statements off — :func:`prepared_statements`, for a transaction pooler such as PgBouncer —
no session state at all: each call sends its bound as ``SET LOCAL`` in its own query
string, as on Django's connection). Celery's Django
fixup closes Django's connections around every task unless ``CELERY_DB_REUSE_MAX`` is
set; it does not know this one, so start and settle never pay a reconnect, and
PostgreSQL parses and plans each call once per connection, not once per call. Inside a
transaction of Django's connection (a caller's ``atomic()``, the test suite) the call
runs on that connection, as part of that transaction.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, ClassVar

from django.core.serializers.json import DjangoJSONEncoder
from django.db import DatabaseError, IntegrityError, ProgrammingError, connection, transaction

from pools import conf, signals
from pools.core.locking import (
    BOUND,
    bound_client_options,
    bound_params,
    schema_behind,
    unavailable,
)
from pools.models import PoolEvent
from pools.pg import functions


def enabled() -> bool:
    """True when enqueue, settle and start run as stored-function calls."""
    return connection.vendor == "postgresql" and conf.get().SQL_FAST_PATH


def listening() -> bool:
    """True when some lifecycle signal has a receiver (the functions then return events)."""
    return any(signal.has_listeners(PoolEvent) for signal in signals.BY_KIND.values())


@dataclass(frozen=True, kw_only=True)
class Row:
    """One row of a stored function (the ``out`` function): each column has one meaning.

    ``kind`` says which columns are set (see the comment above it in ``schema.sql``).
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
    #: True when the call ran in its own transaction on pools' own connection, which has
    #: committed: after-commit work runs now (Django's ``on_commit`` would open Django's
    #: connection just to learn that it is in autocommit).
    committed: bool = False

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
        """Pools with a delayed entry due later or a rate window closed: when to run
        admission again (the earlier time when a pool has both)."""
        due: dict[str, datetime] = {}
        for r in self.of("wake"):
            if r.pool and r.at and (r.pool not in due or r.at < due[r.pool]):
                due[r.pool] = r.at
        return due

    @property
    def events(self) -> list[PoolEvent]:
        """The events of the call's transitions (only when it was asked to return them).

        In the order the function returned them; rows of version 4 have no id (the normal
        transitions are not written to the event log).
        """
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
            for r in self.of("event")
        ]


def decode(
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    committed: bool = False,
    jsonb_as_text: bool = False,
) -> Reply:
    """Rows of a stored function as :class:`Row` objects, by column name (``o_`` dropped).

    ``jsonb_as_text``: the connection hands ``jsonb`` columns over as their JSON text (Django's
    connection does, for its ``JSONField``); pools' own connection hands them over decoded.
    Either way a stored value decodes: a ``jsonb`` string (the display text of arguments
    Celery serialized with types JSON does not have) stays the string it is.
    """
    names = [c[2:] if c.startswith("o_") else c for c in columns]
    unknown = set(names) - _NAMES
    if unknown:  # pragma: no cover - a function and this module disagree
        raise ProgrammingError(f"unexpected fast-path columns: {sorted(unknown)}")
    decoded = []
    for values in rows:
        data = dict(zip(names, values, strict=True))
        for name in _JSON & data.keys():
            data[name] = json_value(data[name], as_text=jsonb_as_text)
        decoded.append(Row(**data))
    return Reply(decoded, committed=committed)


def lock_ms() -> int:
    """``LOCK_TIMEOUT_SECONDS`` in milliseconds: the functions' ``p_lock_ms`` argument."""
    return int(conf.get().LOCK_TIMEOUT_SECONDS * 1000)


def call(function: str, params: Sequence[Any], *, what: str) -> Reply:
    """``SELECT * FROM function(params, p_lock_ms)`` under the bound.

    Errors become :class:`PoolUnavailable` (integrity and programming errors, which are
    bugs or a missing migration, are not disguised). The function sets ``lock_timeout``
    itself from its last argument; ``statement_timeout`` comes from the connection: on
    pools' own connection (see the module docstring) a session setting, on Django's
    connection a ``SET LOCAL`` in the same query string. Inside a caller's transaction the
    call gets a savepoint, so a timeout does not break the caller's transaction (the bound
    then stays set until that transaction ends, as on the ORM path); in autocommit the
    query string is its own transaction.
    """
    args = [*params, lock_ms()]
    placeholders = ", ".join(["%s"] * len(args))
    columns, rows, own = _select(f"SELECT * FROM {function}({placeholders})", args, what)
    return (
        decode(columns, rows, committed=True) if own else decode(columns, rows, jsonb_as_text=True)
    )


def _select(query: str, args: list[Any], what: str) -> tuple[list[str], list[Any], bool]:
    """Run ``query`` under the bound (see :func:`call`): on pools' own connection outside a
    transaction when it is on, else on Django's (in a savepoint inside a transaction).
    Returns its columns, its rows, and whether it ran on pools' own connection (its rows
    are then committed and its ``jsonb`` values decoded)."""
    if _own.enabled and not connection.in_atomic_block:
        return (*_execute_own(query, args, what), True)
    guard = transaction.atomic() if connection.in_atomic_block else nullcontext()
    with _outage(what), guard, connection.cursor() as cursor:
        cursor.execute(f"{BOUND}{query}", [*bound_params(), *args])
        while cursor.description is None and cursor.nextset():
            pass  # past the SET results
        return [c.name for c in cursor.description or ()], cursor.fetchall(), False


@contextmanager
def _outage(what: str) -> Iterator[None]:
    """Django's connection: database errors as :class:`PoolUnavailable`; integrity and
    programming errors (bugs) pass as they are, unless the schema is behind this code
    (deployed before ``migrate``: an outage)."""
    try:
        yield
    except (IntegrityError, ProgrammingError) as exc:
        if schema_behind(exc):
            raise unavailable(what, exc) from exc
        raise  # a bug, not an outage: do not disguise it
    except DatabaseError as exc:
        raise unavailable(what, exc) from exc


def call_procedure(procedure: str, params: Sequence[Any], *, what: str) -> Reply:
    """``CALL procedure(params, NULL)`` outside a transaction: the procedure commits its
    own work (and looks again for work other calls left to it: pools_recheck in
    ``schema.sql``), so it cannot run inside one. Its rows come back as one ``jsonb``
    array (its ``INOUT o_rows``), decoded as :func:`decode` decodes a function's rows.

    The call runs in autocommit on pools' own connection (a prepared statement unless
    prepared statements are off) or on Django's connection. No ``SET LOCAL`` of the
    statement bound precedes it (a statement before it in one query string would make an
    implicit transaction, where a procedure may not commit): its lock waits are bounded by
    ``lock_timeout``, which it sets itself, and by the session's ``statement_timeout`` on
    pools' own prepared connection. Errors as :func:`call`.
    """
    if connection.in_atomic_block:  # pragma: no cover - the engine checks first
        raise RuntimeError(f"{procedure} commits: it cannot run inside a transaction")
    query = f"CALL {procedure}({', '.join(['%s'] * (len(params) + 1))})"
    args = [*params, None]
    if _own.enabled:
        _, rows = _execute_own(query, args, what, bound=False)
        return _rows_of(rows[0][0] if rows else None, as_text=False)
    with _outage(what), connection.cursor() as cursor:
        cursor.execute(query, args)
        row = cursor.fetchone()
    return _rows_of(row[0] if row else None, as_text=True)


def owe_pass(names: Sequence[str], *, what: str) -> None:
    """Leave an admission pass over pools ``names`` owed to their lock holders, committed
    (``pools_owe`` with 0 slots, outside a transaction): a holder that took a pool's lock
    before this commit looks for owed work after its own commit; the caller looks after
    this one (:func:`pools.pg.engine.wake`). Unknown names are ignored."""
    if connection.in_atomic_block:  # pragma: no cover - the engine checks first
        raise RuntimeError("an owed pass must be committed before the caller looks again")
    query = (
        f"SELECT count({functions.name('owe')}(p.id, 0)) FROM pools_pool p WHERE p.name = ANY(%s)"
    )
    _select(query, [list(names)], what)


def _rows_of(array: Any, *, as_text: bool) -> Reply:
    """A procedure's ``o_rows`` (a ``jsonb`` array of output rows) as a committed :class:`Reply`."""
    items = json_value(array, as_text=as_text) or []
    rows = []
    for item in items:
        data = {k[2:]: v for k, v in item.items()}
        if data.get("at") is not None:
            data["at"] = datetime.fromisoformat(data["at"])
        rows.append(Row(**data))
    return Reply(rows, committed=True)


class _Own(threading.local):
    """Per thread: pools' own connection. ``enabled`` is the process's choice."""

    enabled: ClassVar[bool] = False
    conn: Any = None
    pid: int = 0
    timeout_ms: int = -1


_own = _Own()


def use_own_connection(enabled: bool = True) -> None:
    """Run calls made outside a transaction on pools' own connection (this thread).

    Called in each worker process at ``worker_process_init`` (and by the W7 benchmark).
    ``enabled=False`` closes it.
    """
    _Own.enabled = enabled  # for every thread of the process (``-P threads`` included)
    if not enabled:
        close_own_connection()


def close_own_connection() -> None:
    """Close this thread's own connection (the next call opens a new one)."""
    conn, _own.conn = _own.conn, None
    if conn is not None and _own.pid == os.getpid():
        try:
            conn.close()
        except Exception:
            pass


# A forked child must neither use nor close (PQfinish would end the parent's session on
# the shared socket) a connection it inherited: the parent closes its own before forking
# (Celery's prefork pool forks from the thread that uses it) and reopens it when needed.
_inherited: list[Any] = []
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=lambda: close_own_connection())


def prepared_statements() -> bool:
    """True when pools' own connection prepares its calls on the server.

    ``POOLS["PREPARED_STATEMENTS"]`` when it is set; otherwise off exactly when the
    database's ``OPTIONS["prepare_threshold"]`` is ``None``, the setting Django documents
    for a transaction pooler (PgBouncer ``pool_mode = transaction``), where a statement
    prepared on one server connection is missing, or already there, on the next. Off, the
    connection keeps no session state either (see :func:`_execute_own`).
    """
    chosen = conf.get().PREPARED_STATEMENTS
    if chosen is not None:
        return chosen
    options = connection.settings_dict.get("OPTIONS") or {}
    return not ("prepare_threshold" in options and options["prepare_threshold"] is None)


def _prepare_params() -> dict[str, Any]:
    """Connection parameters of the prepare switch: none, or psycopg's ``prepare_threshold=None``."""
    return {} if prepared_statements() else {"prepare_threshold": None}


def _connect() -> Any:
    """This thread's own connection, opened (or reopened after a fork or an error) if needed."""
    conn = _own.conn
    if conn is not None and (_own.pid != os.getpid() or conn.closed or conn.broken):
        if _own.pid == os.getpid():
            close_own_connection()
        else:  # inherited through a fork: never used, never finalized (see above)
            _inherited.append(conn)
        conn = _own.conn = None
    if conn is None:
        import psycopg

        params = {
            k: v
            for k, v in connection.get_connection_params().items()
            if k not in {"cursor_factory", "context", "prepare_threshold"}
        }
        conn = psycopg.connect(autocommit=True, **_bounded(params), **_prepare_params())
        _own.conn, _own.pid, _own.timeout_ms = conn, os.getpid(), -1
    ms = lock_ms()
    if _own.timeout_ms != ms and prepared_statements():  # else SET LOCAL per call
        conn.execute(f"SET statement_timeout = {ms}")  # an int: nothing to quote
        _own.timeout_ms = ms
    return conn


def _bounded(params: dict[str, Any]) -> dict[str, Any]:
    """Connection parameters with the client-side socket bounds (connect timeout, TCP
    keepalives, ``tcp_user_timeout``) for the keys the user did not set: a hung socket
    fails within a bound instead of blocking a worker forever."""
    return bound_client_options(params)


def own_backend_pid() -> int:
    """The server process id of this thread's own connection (opened if needed)."""
    return int(_connect().info.backend_pid)


def _execute_own(
    query: str, args: list[Any], what: str, *, bound: bool = True
) -> tuple[list[str], list[Any]]:
    """Run ``query`` on pools' own connection, as a server-side prepared statement; its
    columns and rows.

    With prepared statements off (:func:`prepared_statements`) the query is sent as Django
    sends it: client-side bound, after ``SET LOCAL`` of the bound in the same query string
    (one implicit transaction), so nothing outlives the call on the server connection.
    ``bound=False``: no ``SET LOCAL`` before it when prepared statements are off (a
    procedure's ``CALL``, see :func:`call_procedure`).
    """
    import psycopg

    try:
        conn = _connect()
        prepared = prepared_statements()
        with conn.cursor() if prepared else psycopg.ClientCursor(conn) as cursor:
            if prepared:
                cursor.execute(query, args, prepare=True)
            elif bound:
                cursor.execute(f"{BOUND}{query}", [*bound_params(), *args], prepare=False)
                while cursor.description is None and cursor.nextset():
                    pass  # past the SET results
            else:
                cursor.execute(query, args, prepare=False)
            return [c.name for c in cursor.description or ()], cursor.fetchall()
    except psycopg.IntegrityError as exc:
        raise IntegrityError(str(exc)) from exc
    except psycopg.ProgrammingError as exc:
        if schema_behind(exc):
            raise unavailable(what, exc) from exc
        raise ProgrammingError(str(exc)) from exc
    except psycopg.Error as exc:
        if _own.conn is not None and (_own.conn.broken or _own.conn.closed):
            close_own_connection()
        raise unavailable(what, exc) from exc


def pool_rates(names: Sequence[str]) -> dict[str, str]:
    """``{name: rate}`` of the named pools, read on the connection the calls use: pools' own
    in a worker (outside a transaction), so a worker process keeps one connection.

    A plain read, not prepared (nothing outlives it behind a transaction pooler); an error
    raises :class:`PoolUnavailable`.
    """
    query = "SELECT name, rate FROM pools_pool WHERE name = ANY(%s)"
    what = "reading which pools have a rate"
    if not (_own.enabled and not connection.in_atomic_block):
        try:
            with connection.cursor() as cursor:
                cursor.execute(query, [list(names)])
                return dict(cursor.fetchall())
        except DatabaseError as exc:
            raise unavailable(what, exc) from exc
    import psycopg

    try:
        conn = _connect()
        # As _execute_own sends an unprepared call: bound on the client, so nothing (not even
        # an unnamed statement) is left to a pooler's next client.
        with conn.cursor() if prepared_statements() else psycopg.ClientCursor(conn) as cursor:
            cursor.execute(query, [list(names)], prepare=False)
            return dict(cursor.fetchall())
    except psycopg.Error as exc:
        if _own.conn is not None and (_own.conn.broken or _own.conn.closed):
            close_own_connection()
        raise unavailable(what, exc) from exc


def jsonb(value: Any) -> str:
    """A parameter for a ``jsonb`` argument, encoded as the model's JSON fields encode it."""
    return json.dumps(value, cls=DjangoJSONEncoder)


def json_value(value: Any, *, as_text: bool) -> Any:
    """A ``jsonb`` column as Python data.

    ``as_text``: the driver handed it over as JSON text (always valid JSON: PostgreSQL wrote
    it), which is parsed; otherwise the driver decoded it and it is returned as it is. Only
    the connection knows which: a decoded ``jsonb`` string is a ``str`` too.
    """
    if as_text and isinstance(value, str | bytes):
        return json.loads(value)
    return value
