"""Row locks and the operation bound: the only place pools' rows are locked.

Lock order (every transaction follows it, so none can deadlock another): pool rows
``SELECT ... FOR UPDATE`` ordered by name, then entry and demand rows of those pools
(plain ``UPDATE``s). Each transaction is bounded by ``LOCK_TIMEOUT_SECONDS`` (lock waits
and each statement); database errors and passed bounds surface as
:class:`~pools.exceptions.PoolUnavailable` with a one-line reason (the driver's full text
is logged on ``pools.locking`` and kept as ``__cause__``).

One lock is taken below this module: on MySQL/MariaDB an update of entry rows first locks
them by primary key (:func:`pools.querysets.update_by_primary_key`, which every
``QueueEntry.objects...update()`` goes through), so that storage never imports the core.

How the bound is set, per database:

* PostgreSQL: ``SET LOCAL lock_timeout`` and ``statement_timeout`` inside the transaction;
  the server drops them when the transaction ends. A transaction pools opens itself also
  gets ``idle_in_transaction_session_timeout`` and the server-side ``tcp_user_timeout``
  (both the bound), so a process frozen or cut off by a silent partition while holding
  pool locks loses its session instead of blocking the pools until it comes back.
  Workers also bound their sockets on the client side (:func:`client_bounds`).
* MySQL / MariaDB (InnoDB): there is no transaction-scoped ``SET``, so the session
  variables ``innodb_lock_wait_timeout`` (whole seconds, rounded up) and
  ``max_statement_time`` (MariaDB, seconds) or ``max_execution_time`` (MySQL,
  milliseconds; it only applies to read-only ``SELECT``) are set for the pools
  transaction and restored right after it, success or failure. One statement saves the
  session's values in user variables (``@pools_saved_*``) and sets the bound; one
  statement after the transaction sets them back. Nested pools transactions save and
  restore only once (the outermost).
* SQLite: the driver's ``timeout`` (busy wait) bounds lock waits; nothing is set here.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from django.db import (
    DatabaseError,
    IntegrityError,
    ProgrammingError,
    connection,
    transaction,
)

from pools import conf
from pools.exceptions import PoolUnavailable
from pools.models import Pool, PoolOverride

logger = logging.getLogger("pools.locking")

#: Sets the bound of the statement that follows it in the same query string (PostgreSQL).
#: A ``statement_timeout`` set inside a function would not bound the running statement.
BOUND = "SET LOCAL lock_timeout = %s; SET LOCAL statement_timeout = %s; "

#: MariaDB: save the session's values, then set the bound (one round trip).
MARIADB_BOUND = (
    "SET @pools_saved_lock_wait = @@SESSION.innodb_lock_wait_timeout, "
    "@pools_saved_statement_time = @@SESSION.max_statement_time, "
    "SESSION innodb_lock_wait_timeout = %s, SESSION max_statement_time = %s"
)
MARIADB_RESTORE = (
    "SET SESSION innodb_lock_wait_timeout = @pools_saved_lock_wait, "
    "SESSION max_statement_time = @pools_saved_statement_time"
)
#: MySQL: the same with ``max_execution_time`` (milliseconds, read-only SELECTs only).
MYSQL_BOUND = (
    "SET @pools_saved_lock_wait = @@SESSION.innodb_lock_wait_timeout, "
    "@pools_saved_execution_time = @@SESSION.max_execution_time, "
    "SESSION innodb_lock_wait_timeout = %s, SESSION max_execution_time = %s"
)
MYSQL_RESTORE = (
    "SET SESSION innodb_lock_wait_timeout = @pools_saved_lock_wait, "
    "SESSION max_execution_time = @pools_saved_execution_time"
)


def bound_params() -> list[str]:
    """Parameters of :data:`BOUND`: ``LOCK_TIMEOUT_SECONDS`` for both timeouts."""
    ms = f"{int(conf.get().LOCK_TIMEOUT_SECONDS * 1000)}ms"
    return [ms, ms]


def mysql_bound() -> tuple[str, str, list[float | int]]:
    """``(set, restore, params)`` of the session bound on this MySQL/MariaDB connection.

    ``innodb_lock_wait_timeout`` takes whole seconds (at least 1): rounded up, so a lock
    wait is never cut shorter than ``LOCK_TIMEOUT_SECONDS``. On MariaDB
    ``max_statement_time`` (fractional seconds) also bounds a lock wait, so the bound
    there is ``LOCK_TIMEOUT_SECONDS`` itself.
    """
    seconds = conf.get().LOCK_TIMEOUT_SECONDS
    lock_wait = max(1, math.ceil(seconds))
    if getattr(connection, "mysql_is_mariadb", False):
        return MARIADB_BOUND, MARIADB_RESTORE, [lock_wait, seconds]
    return MYSQL_BOUND, MYSQL_RESTORE, [lock_wait, max(1, math.ceil(seconds * 1000))]


def set_bound(*, idle: bool = False) -> None:
    """Bound the rest of the current transaction (PostgreSQL), in one statement.

    The same ``SET LOCAL`` the fast path sends in front of each call; with ``idle`` (a
    transaction pools opened itself, not a caller's) also
    ``idle_in_transaction_session_timeout``: a process frozen while it holds pool locks
    (SIGSTOP, a paused VM) loses its session after :data:`IDLE_BOUND_FACTOR` times the
    bound instead of blocking the pools until it resumes. On MySQL/MariaDB the bound is
    a pair of session variables that must be restored after the transaction:
    :func:`bounded_transaction` (or :func:`bounded`) sets it, and this does nothing there.
    """
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(*bound_sql(idle=idle))


def bound_sql(*, idle: bool) -> tuple[str, list[str]]:
    """The statement (and its parameters) :func:`set_bound` sends on PostgreSQL."""
    sql, params = BOUND.rstrip("; "), bound_params()
    if idle:
        sql += (
            "; SET LOCAL idle_in_transaction_session_timeout = %s; SET LOCAL tcp_user_timeout = %s"
        )
        ms = int(conf.get().LOCK_TIMEOUT_SECONDS * IDLE_BOUND_FACTOR * 1000)
        params = [*params, f"{ms}ms", f"{ms}ms"]
    return sql, params


#: A process frozen inside a pools transaction, or cut off from the server by a silent
#: network partition, would keep its pool row locks until it resumes (or for as long as
#: TCP takes to give up, hours by default): the server ends such a session once it has
#: been idle in the transaction this many times ``LOCK_TIMEOUT_SECONDS``, and (server-side
#: ``tcp_user_timeout``) once data it sent has gone unacknowledged for as long. Measured
#: behind a black-holed socket: the row lock was free 5.0 s after the cut with the default
#: bound (15.0 s when this factor was 3).
IDLE_BOUND_FACTOR = 1


def client_bounds() -> dict[str, int]:
    """libpq connection options that bound a hung socket on the client (PostgreSQL).

    ``connect_timeout`` (whole seconds, at least 2), TCP keepalives that find a silent
    peer in about ``LOCK_TIMEOUT_SECONDS`` + 3 s, and ``tcp_user_timeout``: data sent but
    not acknowledged for ``LOCK_TIMEOUT_SECONDS`` ends the connection. Pools' own worker
    connection uses them, and workers add them to Django's connection (without overriding
    a key the user set in ``OPTIONS``): :func:`pools.celery.worker` at process start.
    """
    seconds = conf.get().LOCK_TIMEOUT_SECONDS
    return {
        "connect_timeout": max(2, math.ceil(seconds)),
        "keepalives": 1,
        "keepalives_idle": max(1, math.ceil(seconds)),
        "keepalives_interval": 1,
        "keepalives_count": 3,
        "tcp_user_timeout": max(1, int(seconds * 1000)),
    }


def bound_client_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` (a database's ``OPTIONS``) with :func:`client_bounds` for unset keys."""
    return {**client_bounds(), **options}


# --------------------------------------------------------------------------- errors

#: MySQL/MariaDB error codes -> (kind of failure).
_MYSQL_KINDS = {
    1205: "lock",  # ER_LOCK_WAIT_TIMEOUT (innodb_lock_wait_timeout)
    1969: "statement",  # ER_STATEMENT_TIMEOUT (MariaDB max_statement_time)
    3024: "statement",  # ER_QUERY_TIMEOUT (MySQL max_execution_time)
    1213: "deadlock",  # ER_LOCK_DEADLOCK
    1040: "connection",  # ER_CON_COUNT_ERROR (too many connections)
    2002: "connection",  # CR_CONNECTION_ERROR
    2003: "connection",  # CR_CONN_HOST_ERROR
    2006: "connection",  # CR_SERVER_GONE_ERROR
    2013: "connection",  # CR_SERVER_LOST
    4031: "connection",  # ER_CLIENT_INTERACTION_TIMEOUT (MySQL 8)
}
#: PostgreSQL SQLSTATEs (and classes) -> kind of failure.
_PG_KINDS = {
    "55P03": "lock",  # lock_not_available (lock_timeout)
    "57014": "statement",  # query_canceled (statement_timeout)
    "40P01": "deadlock",  # deadlock_detected
    "40001": "deadlock",  # serialization_failure
    "53300": "connection",  # too_many_connections
    "57P01": "connection",  # admin_shutdown
    "42883": "schema",  # undefined_function: a stored function of this release is missing
}
_ADVICE = {
    "schema": "the database schema is older than this release of django-celery-pools: "
    "run 'manage.py migrate'",
    "lock": "another transaction held a pool row past LOCK_TIMEOUT_SECONDS ({s:g}s); "
    "retry, and look for a long transaction locking pools_pool rows",
    # The statement bound also cuts lock waits (MariaDB, PostgreSQL): either may be it.
    "statement": "a lock wait or statement passed LOCK_TIMEOUT_SECONDS ({s:g}s); retry, "
    "look for a long transaction locking pools_pool rows, or raise LOCK_TIMEOUT_SECONDS "
    "if the database is overloaded",
    "deadlock": "the database broke a deadlock by rolling this transaction back; retry "
    "(pools locks rows in name order: look for other code locking pools rows)",
    "connection": "the database connection failed; check that the database server "
    "is up and accepts connections",
    "locked": "SQLite stayed locked past its busy timeout; retry, or set "
    "OPTIONS['transaction_mode'] = 'IMMEDIATE' (check pools.W001)",
}


def _first_line(text: str) -> str:
    """The first non-empty line of ``text``, whitespace collapsed."""
    for line in text.splitlines():
        if line.strip():
            return " ".join(line.split())
    return ""


def describe(exc: BaseException) -> tuple[str, str]:
    """``(kind, message)`` of a database error: one line from the driver's own message.

    ``kind`` is ``lock``, ``statement``, ``deadlock``, ``connection``, ``locked`` (SQLite)
    or ``other``.
    """
    cause = exc.__cause__ or exc
    # PostgreSQL (psycopg): SQLSTATE and the primary message (no LINE/QUERY/CONTEXT).
    sqlstate = getattr(cause, "sqlstate", None)
    if isinstance(sqlstate, str):
        diag = getattr(cause, "diag", None)
        primary = getattr(diag, "message_primary", None) or _first_line(str(cause))
        kind = _PG_KINDS.get(sqlstate) or ("connection" if sqlstate[:2] == "08" else "other")
        return kind, _first_line(primary)
    # MySQL/MariaDB (mysqlclient): args are (code, message).
    args: tuple[object, ...] = tuple(getattr(cause, "args", ()))
    if len(args) >= 2 and isinstance(args[0], int) and isinstance(args[1], str):
        return _MYSQL_KINDS.get(args[0], "other"), f"{_first_line(args[1])} [{args[0]}]"
    message = _first_line(str(cause)) or type(cause).__name__
    if "database is locked" in message or "database table is locked" in message:
        return "locked", message
    if isinstance(cause, DatabaseError) and "connection" in message.lower():
        return "connection", message
    return "other", message


def unavailable(what: str, exc: BaseException) -> PoolUnavailable:
    """The :class:`PoolUnavailable` for database error ``exc`` during ``what``.

    Its message is one line a user can act on: ``pool state is unavailable (what):
    <driver's first line>; <what to do>``. The driver's full text (PostgreSQL's
    ``LINE``/``QUERY``/``CONTEXT`` lines, MySQL's error code) goes to the ``pools.locking``
    log; raise it ``from exc`` to keep the original as ``__cause__``.
    """
    kind, message = describe(exc)
    advice = _ADVICE.get(kind, "see the pools.locking log for the database's detail")
    text = advice.format(s=conf.get().LOCK_TIMEOUT_SECONDS)
    logger.info("pool state is unavailable (%s): %s", what, str(exc).strip() or repr(exc))
    return PoolUnavailable(_first_line(f"pool state is unavailable ({what}): {message}; {text}"))


def schema_behind(exc: BaseException) -> bool:
    """True when ``exc`` says the database lacks a stored function of this release: the
    code was deployed before ``migrate`` ran (see :func:`unavailable`'s advice)."""
    return describe(exc)[0] == "schema"


@contextmanager
def unavailable_on_error(what: str) -> Iterator[None]:
    """Database errors and timeouts inside surface as :class:`PoolUnavailable`.

    Integrity and programming errors (bugs, a missing migration) are not disguised.
    """
    try:
        yield
    except (IntegrityError, ProgrammingError):
        raise  # a bug or a schema problem, not an outage: do not disguise it
    except DatabaseError as exc:
        raise unavailable(what, exc) from exc


# --------------------------------------------------------------------------- the bound

#: Depth of nested bounded transactions per MySQL connection (only the outermost
#: saves and restores the session variables).
_depth = threading.local()


def drop_broken_connection() -> None:
    """Close Django's connection if its last statement failed and it no longer works.

    Long-lived processes keep their connection: beat and scripts calling pooled tasks, and
    Celery pool processes (``CELERY_DB_REUSE_MAX`` keeps a connection for that many tasks,
    dead or alive, and nothing else checks it). After a PostgreSQL restart every later
    call would fail on "the connection is closed"; with this the next one reconnects. The
    gate calls it after a refused call, workers before every task pools runs (pooled bodies,
    settles, sweeps, wake-ups). It costs an attribute read unless a statement failed;
    inside the caller's own transaction it leaves the connection alone.
    """
    if connection.connection is None or connection.in_atomic_block:
        return
    if connection.errors_occurred and not connection.is_usable():
        connection.close()


@contextmanager
def _mysql_session_bound() -> Iterator[None]:
    """Set the session bound for the block and restore the session's values after it."""
    depth = getattr(_depth, "n", 0)
    if connection.vendor != "mysql" or depth:
        _depth.n = depth + 1
        try:
            yield
        finally:
            _depth.n = depth
        return
    set_sql, restore_sql, params = mysql_bound()
    with connection.cursor() as cursor:
        cursor.execute(set_sql, params)
    _depth.n = 1
    try:
        yield
    finally:
        _depth.n = 0
        _restore(restore_sql)


def _restore(restore_sql: str) -> None:
    """Set the session variables back (lock timeouts, foreign key checks). Never raises:
    the pools work is already done.

    After a failure that broke the caller's transaction (a deadlock inside an outer
    ``atomic``) Django refuses queries until that block ends, so the statement goes
    through the driver's connection directly (session variables are not transactional).
    A connection that is gone has no session left to restore.
    """
    raw = connection.connection
    if raw is None:
        return
    try:
        if connection.needs_rollback:
            with raw.cursor() as cursor:
                cursor.execute(restore_sql)
        else:
            with connection.cursor() as cursor:
                cursor.execute(restore_sql)
    except DatabaseError as exc:  # pragma: no cover - the connection broke meanwhile
        logger.warning("could not restore the session's settings: %s", exc)
        connection.close_if_unusable_or_obsolete()
    except Exception as exc:  # the raw driver's own error class  # pragma: no cover
        logger.warning("could not restore the session's settings: %s", exc)


#: MySQL/MariaDB: foreign keys unchecked for a block, the session's own setting saved.
FK_UNCHECKED = "SET @pools_saved_fk = @@SESSION.foreign_key_checks, SESSION foreign_key_checks = 0"
FK_RESTORE = "SET SESSION foreign_key_checks = @pools_saved_fk"


@contextmanager
def parent_rows_unlocked() -> Iterator[None]:
    """Rows inserted inside lock no row their foreign keys point at (MySQL/MariaDB).

    InnoDB checks a foreign key at the insert and keeps a shared lock on the referenced
    row until the transaction ends: a line row inserted in a caller's transaction would
    hold its pool row until the caller commits, and every admission of that pool would
    wait. Inside this block the session's ``foreign_key_checks`` is off (its own value
    is back after the block, success or failure), so the caller checks that the rows it
    references exist. Does nothing on other databases (PostgreSQL checks the deferred
    keys at commit; SQLite serializes writers anyway).
    """
    if connection.vendor != "mysql":
        yield
        return
    with connection.cursor() as cursor:
        cursor.execute(FK_UNCHECKED)
    try:
        yield
    finally:
        _restore(FK_RESTORE)


@contextmanager
def bounded_transaction() -> Iterator[None]:
    """A transaction bounded by ``LOCK_TIMEOUT_SECONDS``; database errors propagate as such.

    For callers that handle :class:`~django.db.DatabaseError` themselves (the lease
    keeper's renewal). On MySQL/MariaDB the session variables are restored after it.
    """
    outermost = not connection.in_atomic_block
    with _mysql_session_bound(), transaction.atomic():
        set_bound(idle=outermost)
        yield


@contextmanager
def bounded(what: str) -> Iterator[None]:
    """A transaction bounded by ``LOCK_TIMEOUT_SECONDS`` (lock waits and each statement);
    errors as in :func:`unavailable_on_error`."""
    with unavailable_on_error(what), bounded_transaction():
        yield


@contextmanager
def locked_pools(names: Iterable[str]) -> Iterator[dict[str, Pool]]:
    """Open a bounded transaction holding the row locks of ``names`` (in name order).

    Database errors and lock timeouts surface as :class:`PoolUnavailable`. On PostgreSQL
    the holder looks again for work left to it after its commit, or after its rollback
    (docs/concepts/admission.md#contention-the-lock-holder-admits-for-everyone).
    """
    wanted = sorted(set(names))
    if connection.vendor != "postgresql":
        with bounded(f"pools {', '.join(wanted)}"):
            pools = list(Pool.objects.select_for_update().filter(name__in=wanted).order_by("name"))
            yield {p.name: p for p in pools}
        return
    held = False
    try:
        with bounded(f"pools {', '.join(wanted)}"):
            # FOR NO KEY UPDATE: a call that found a pool locked may insert rows referencing
            # it (their foreign-key check takes KEY SHARE) without waiting for this
            # transaction. Work that calls which found these pools locked left to the holder
            # (owed releases count as held until then) is taken by the admission pass run
            # under these locks (held.apply_owed), and looked for again after the commit or
            # the rollback (the hooks below).
            locked = Pool.objects.select_for_update(no_key=True).filter(name__in=wanted)
            pools = list(locked.order_by("name"))
            held = True
            for hook in _after_locks:
                transaction.on_commit(lambda hook=hook: hook(wanted))  # type: ignore[misc]
            yield {p.name: p for p in pools}
    except Exception:
        if held:
            _look_after_rollback(wanted)
        raise


def _look_after_rollback(names: list[str]) -> None:
    """The transaction that held the locks of ``names`` rolled back (a refusal raised under
    the locks, an error): its look after commit went with it, but calls that found those
    pools locked may have left work to it meanwhile, and they looked only while it held
    the locks. Look now (the locks are free), or after the caller's commit when the
    rollback was of a savepoint inside the caller's transaction. Never raises: the error
    that rolled back is the caller's."""
    for hook in _after_locks:
        if connection.in_atomic_block:
            transaction.on_commit(lambda hook=hook: hook(names))  # type: ignore[misc]
            continue
        try:
            hook(names)
        except Exception:  # pragma: no cover - the hooks log their own failures
            logger.warning("pools %s: the look after a rollback failed", ", ".join(names))


#: What runs after a commit that held pool locks on PostgreSQL, with the pools' names: the
#: look for work that calls which found them locked left to the holder
#: (docs/concepts/admission.md#contention), registered by :mod:`pools.core.engine`.
_after_locks: list[Callable[[list[str]], None]] = []


def after_locks(hook: Callable[[list[str]], None]) -> None:
    """Register what :func:`locked_pools` runs after its commit on PostgreSQL."""
    _after_locks[:] = [hook]


@contextmanager
def locked_override(name: str) -> Iterator[PoolOverride | None]:
    """A bounded transaction holding the lock of per-key pool ``name``'s override row
    (None when it has none: the caller may insert it; a concurrent insert of the same
    name fails on the unique name)."""
    with bounded(f"overrides of {name}"):
        yield PoolOverride.objects.select_for_update().filter(pool=name).first()
