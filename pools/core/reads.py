"""Bounded reads: what the REST API and the admin read, bounded like every pool operation.

On PostgreSQL a read runs in a transaction with ``LOCK_TIMEOUT_SECONDS`` as its lock and
statement timeout, so a table locked by a migration or a stuck session makes pool state
unavailable at the bound instead of hanging the request. Elsewhere (SQLite) it runs as
it is — an ``IMMEDIATE`` transaction would take the write lock for a read — and only its
database errors become :class:`~pools.exceptions.PoolUnavailable`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection

from pools.core import locking


@contextmanager
def bounded_read(what: str) -> Iterator[None]:
    """Run the block's reads bounded (PostgreSQL); errors as :class:`PoolUnavailable`."""
    if connection.vendor == "postgresql":
        with locking.bounded(what):
            yield
    else:
        with locking.unavailable_on_error(what):
            yield
