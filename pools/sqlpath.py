"""The PostgreSQL fast path: when it applies, and how its stored functions are called.

Settle+admit and start each run as one call of a function created by migration 0002
(``pools/sql/admission_v2.sql``): one round trip, so a pool's row lock is held for the
time the database needs, not for a dozen client round trips. The functions follow the
rules of :mod:`pools.admission` and hand anything unusual (multi-pool heads, deadlines,
``not_before``) back to it. They are used when:

* the database is PostgreSQL and ``POOLS["SQL_FAST_PATH"]`` is true (the default), and
* nobody listens to the lifecycle signals the call would have to send (the ORM path
  sends them; the functions write the same event rows without building model objects).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import DatabaseError, IntegrityError, ProgrammingError, connection, transaction

from pools import conf, signals
from pools.exceptions import PoolUnavailable
from pools.models import PoolEvent


def enabled(*kinds: str) -> bool:
    """True when the fast path may replace an ORM path that records events of ``kinds``."""
    if connection.vendor != "postgresql" or not conf.get().SQL_FAST_PATH:
        return False
    return not any(signals.BY_KIND[kind].has_listeners(PoolEvent) for kind in kinds)


def call(function: str, params: Sequence[Any], *, what: str) -> list[tuple[Any, ...]]:
    """``SELECT * FROM function(params)``; database errors become :class:`PoolUnavailable`.

    Inside a caller's transaction the call gets a savepoint, so a lock timeout does not
    break the caller's transaction; in autocommit the call is its own transaction.
    """
    placeholders = ", ".join(["%s"] * len(params))
    guard = transaction.atomic() if connection.in_atomic_block else nullcontext()
    try:
        with guard, connection.cursor() as cursor:
            cursor.execute(f"SELECT * FROM {function}({placeholders})", list(params))
            return list(cursor.fetchall())
    except (IntegrityError, ProgrammingError):
        raise  # a bug or a missing migration, not an outage: do not disguise it
    except DatabaseError as exc:
        raise PoolUnavailable(f"pool state is unavailable ({what}): {exc}".strip()) from exc


def lock_ms() -> int:
    """``LOCK_TIMEOUT_SECONDS`` in milliseconds, for the functions' ``lock_timeout``."""
    return int(conf.get().LOCK_TIMEOUT_SECONDS * 1000)


def jsonb(value: Any) -> str:
    """A parameter for a ``jsonb`` argument, encoded as the model's JSON fields encode it."""
    return json.dumps(value, cls=DjangoJSONEncoder)


def json_value(value: Any) -> Any:
    """A ``jsonb`` column as Python data (drivers may hand it over as text)."""
    return json.loads(value) if isinstance(value, str | bytes) else value
