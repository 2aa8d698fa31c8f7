"""The fence of a started entry on PostgreSQL: a session-level advisory lock.

A worker that starts an entry on pools' own connection (:func:`pools.pg.fastpath.holds_fences`)
takes this lock in the start function before it reads the entry, and its session keeps it
while the body runs: a duplicate delivery of the same claim (a broker redelivery) finds it
taken and is skipped, with nothing written by either start (docs/concepts/leases.md). The
lock is released by the session's next start, explicitly after a lost lease or a
redelivery, or by the end of the session.

The key is ``(NAMESPACE, entry id mod 2**31 - 1)``, the two-integer form of PostgreSQL's
advisory locks, kept apart from the one-``bigint`` form applications use most.
"""

from __future__ import annotations

from django.db import connection

#: The first key of every fence ("pool" in ASCII): schema.sql spells the same number.
NAMESPACE = 1886351212
_MODULUS = 2147483647


def key(entry_id: int) -> tuple[int, int]:
    """The two integer keys of the fence of ``entry_id``."""
    return NAMESPACE, entry_id % _MODULUS


def taken_elsewhere(entry_id: int) -> bool:
    """True when another session holds the fence of ``entry_id`` (a body of it runs).

    Inside a transaction of Django's connection on PostgreSQL (a requeue under the pools'
    locks): tries the lock for the transaction only (``pg_try_advisory_xact_lock``), so a
    start that comes later in another session finds it taken until this one commits, and
    sees what it wrote. False on other databases.
    """
    if connection.vendor != "postgresql":
        return False
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_xact_lock(%s, %s)", key(entry_id))
        row = cursor.fetchone()
    return not (row and row[0])
