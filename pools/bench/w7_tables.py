"""W7's tables: the ballast of finished entries kept during the runs, the reset between
repetitions, and the waiting line of ``--depths`` (see :mod:`pools.bench.core`)."""

from __future__ import annotations

import uuid

from pools.bench import spread

#: W7's one pool.
POOL = spread.POOL

#: The place of the waiting filler entries (``--depths``): behind every timed entry.
FILLER_ROUND = 2**60


#: Finished entries kept in the tables during the runs (another pool's), as retention
#: keeps them in production: planned against empty tables, the functions' cached plans
#: scan them sequentially, and a run would measure that instead (the figures before
#: 2026-12-05 did: 64-228 admissions/s).
BALLAST = 20_000
BALLAST_POOL = "bench-core-ballast"


def make_ballast() -> None:
    """:data:`BALLAST` finished entries of :data:`BALLAST_POOL` (made once, kept)."""
    from django.db import connection

    from pools.bench import bulk_copy
    from pools.core import admission
    from pools.core.records import Submission
    from pools.models import Pool, QueueEntry
    from pools.specs import PoolSpec
    from pools.states import EntryState

    have = QueueEntry.objects.filter(demand__has_key=BALLAST_POOL).count()
    if have >= BALLAST:
        return
    pool, _ = Pool.objects.get_or_create(name=BALLAST_POOL, defaults={"slots": 1, "paused": True})
    first = Submission(key=str(uuid.uuid4()), task_name="w7.done", spec=PoolSpec.build(pool.name))
    admission.enqueue(first)
    bulk_copy.copy_entries(first.key, range(BALLAST - have - 1), lambda j: [])
    done = EntryState.SUCCEEDED.value
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE pools_queueentry SET state = %s, admitted_at = enqueued_at, "
            "started_at = enqueued_at, finished_at = enqueued_at WHERE queue_id IN "
            "(SELECT entry_id FROM pools_demand WHERE pool_id = %s AND state = 'waiting')",
            [done, pool.pk],
        )
        cursor.execute("UPDATE pools_demand SET state = %s WHERE pool_id = %s", [done, pool.pk])


def reset(*, ballast: bool = True) -> None:
    """Delete W7's pools (one or ``K``) with their entries and events, make (or, with
    ``ballast=False``, delete) the ballast, vacuum and analyze the tables, checkpoint."""
    from django.db import connection

    from pools.models import Pool, PoolEvent, QueueEntry

    QueueEntry.objects.filter(demand__has_key=POOL).delete()
    PoolEvent.objects.filter(pool=POOL).delete()
    Pool.objects.filter(name=POOL).delete()
    spread.delete()
    if ballast:
        make_ballast()
    else:
        QueueEntry.objects.filter(demand__has_key=BALLAST_POOL).delete()
        Pool.objects.filter(name=BALLAST_POOL).delete()
    with connection.cursor() as cursor:
        for table in (
            "pools_queueentry",
            "pools_demand",
            "pools_poolevent",
            "pools_pool",
            "pools_owedwork",
        ):
            cursor.execute(f"VACUUM ANALYZE {table}")
        cursor.execute("CHECKPOINT")


def fill(depth: int, procs: int) -> None:
    """``depth`` entries waiting in the (paused) pool's line, behind every timed entry.

    Each asks for one slot more than the pool will have (``procs``), so one that heads the
    line (no timed entry waits) is never admitted: it waits for its slots, as any head
    does, on the fast path, and a timed entry placed before it goes first.
    """
    from django.db import connection

    from pools.bench import bulk_copy
    from pools.core import admission
    from pools.core.records import Submission
    from pools.models import Pool
    from pools.specs import PoolSpec
    from pools.states import EntryState

    spec = PoolSpec.build(POOL, procs + 1)
    first = Submission(key=str(uuid.uuid4()), task_name="w7.filler", spec=spec)
    admission.enqueue(first)
    bulk_copy.copy_entries(first.key, range(depth - 1), lambda j: [])
    pool = Pool.objects.get(name=POOL)
    key = "'bulk-' || (entry_id %% 100)" if pool.strategy == "fair" else "NULL"
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE pools_demand SET line_round = %s, fairness_key = {key} "
            "WHERE pool_id = %s AND state = %s",
            [FILLER_ROUND, pool.pk, EntryState.WAITING.value],
        )
        cursor.execute("VACUUM ANALYZE pools_demand")
        cursor.execute("VACUUM ANALYZE pools_queueentry")
