"""Row locks and the operation bound: the only place pools' rows are locked.

Lock order (every transaction follows it, so none can deadlock another): pool rows
``SELECT ... FOR UPDATE`` ordered by name, then entry and demand rows of those pools
(plain ``UPDATE``s). Each transaction is bounded by ``LOCK_TIMEOUT_SECONDS`` (lock waits
and each statement); database errors and passed bounds surface as
:class:`~pools.exceptions.PoolUnavailable`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from django.db import DatabaseError, IntegrityError, ProgrammingError, connection, transaction

from pools import conf
from pools.exceptions import PoolUnavailable
from pools.models import Pool

#: Sets the bound of the statement that follows it in the same query string (PostgreSQL).
#: A ``statement_timeout`` set inside a function would not bound the running statement.
BOUND = "SET LOCAL lock_timeout = %s; SET LOCAL statement_timeout = %s; "


def bound_params() -> list[str]:
    """Parameters of :data:`BOUND`: ``LOCK_TIMEOUT_SECONDS`` for both timeouts."""
    ms = f"{int(conf.get().LOCK_TIMEOUT_SECONDS * 1000)}ms"
    return [ms, ms]


def set_bound() -> None:
    """Bound the rest of the current transaction (PostgreSQL; nothing elsewhere yet).

    The same ``SET LOCAL`` the fast path sends in front of each call.
    """
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(BOUND.rstrip("; "), bound_params())


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
        raise PoolUnavailable(f"pool state is unavailable ({what}): {exc}".strip()) from exc


@contextmanager
def bounded(what: str) -> Iterator[None]:
    """A transaction bounded by ``LOCK_TIMEOUT_SECONDS`` (lock waits and each statement);
    errors as in :func:`unavailable_on_error`."""
    with unavailable_on_error(what), transaction.atomic():
        set_bound()
        yield


@contextmanager
def locked_pools(names: Iterable[str]) -> Iterator[dict[str, Pool]]:
    """Open a bounded transaction holding the row locks of ``names`` (in name order).

    Database errors and lock timeouts surface as :class:`PoolUnavailable`.
    """
    wanted = sorted(set(names))
    with bounded(f"pools {', '.join(wanted)}"):
        pools = list(Pool.objects.select_for_update().filter(name__in=wanted).order_by("name"))
        yield {p.name: p for p in pools}
