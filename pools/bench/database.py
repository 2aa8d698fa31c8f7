"""The benchmark's reads of the database itself: one value of a query, the write-ahead log
written since a position (PostgreSQL), and the queue tables vacuumed between runs.

Outside the clock: the workloads read these before and after what they time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db import OperationalError, connection, transaction

from pools.models import Demand, OwedWork, Pool, PoolEvent, QueueEntry


def scalar(sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> Any:
    """The first column of the first row of ``sql`` (None when there is no row)."""
    with connection.cursor() as cursor:
        cursor.execute(sql, params if isinstance(params, dict) else list(params))
        row = cursor.fetchone()
    return row[0] if row else None


def wal_position() -> str | None:
    """PostgreSQL's current write-ahead log position (None on other databases)."""
    if connection.vendor != "postgresql":
        return None
    return str(scalar("SELECT pg_current_wal_lsn()::text"))


#: WAL records of this database since a position: those that touch its relations, and
#: every record (commits included) of the transactions that wrote those (pg_walinspect).
#: Up to the flushed position: pg_walinspect refuses an end past it ("cannot accept future
#: end LSN"), which the insert position can be on a busy server.
_OWN_WAL = """
WITH r AS (
    SELECT xid, record_length, block_ref LIKE %(rel)s AS here
      FROM pg_get_wal_records_info(%(start)s::pg_lsn, pg_current_wal_flush_lsn())
), mine AS (SELECT DISTINCT xid FROM r WHERE here AND xid <> '0')
SELECT COALESCE(sum(record_length), 0) FROM r WHERE here OR xid IN (SELECT xid FROM mine)
"""


def wal_bytes_since(position: str | None) -> float | None:
    """Bytes of write-ahead log written since ``position``.

    With the ``pg_walinspect`` extension in the database (PostgreSQL 15+), only the WAL
    of this database's work counts: other databases of the same server (a shared machine's
    test runs) write WAL too. Without it, everything every session wrote. ``None`` when
    the server has already recycled the WAL since ``position`` (a busy server: raise
    ``wal_keep_size`` to measure it).
    """
    if position is None:
        return None
    if scalar("SELECT count(*) FROM pg_extension WHERE extname = 'pg_walinspect'"):
        dboid = scalar("SELECT oid FROM pg_database WHERE datname = current_database()")
        try:
            with transaction.atomic():
                return float(scalar(_OWN_WAL, {"rel": f"%/{dboid}/%", "start": position}))
        except OperationalError as exc:
            if "has already been removed" not in str(exc):
                raise
            return None
    return float(scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)", [position]))


def settle_tables(*, checkpoint: bool = True) -> None:
    """``VACUUM ANALYZE`` the queue tables, then ``CHECKPOINT`` (PostgreSQL; outside the clock).

    After a bulk load: a line of 100,000 entries written in seconds leaves the planner's
    statistics stale and a checkpoint's worth of dirty pages; a queue that grew to that
    depth over time has neither, and the depth workload should time admission at that
    depth, not the database catching up with the load.

    Before each pooled repetition (``checkpoint=False``): every admission, start and
    settle leaves dead row versions behind. On a production server autovacuum removes
    them about once a minute; on a server where it is off (CI configurations often turn
    it off) they pile up over the run and each repetition would be slower than the last.
    That includes the owed-work table (``pools_owedwork``, rows updated in place
    by every call that found a pool locked), whose dead row versions pile up too.
    """
    if connection.vendor != "postgresql":
        return
    tables = [m._meta.db_table for m in (QueueEntry, Demand, PoolEvent, OwedWork, Pool)]
    with connection.cursor() as cursor:
        for table in tables:
            cursor.execute(f"VACUUM ANALYZE {table}")
        if checkpoint:
            cursor.execute("CHECKPOINT")
