"""Owed work in place (PostgreSQL): a pool's owed work lives in at most 16 rows of
``pools_owedwork`` that calls update without waiting for each other (the ``owe``
function) and that a lock holder takes with ``SKIP LOCKED`` (the ``admit`` function).

Three promises, each on raw sessions so that the moments in between are ours to choose:
a holder does not wait for a call that is writing owed work, and leaves that call's row
to it (nothing is lost: the call looks again after its commit); calls that leave work at
the same moment do not wait for each other; and however many calls leave work, the pool
keeps at most 16 rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from django.db import connections

from pools.models import OwedWork, Pool
from pools.pg import functions
from tests.conftest import POOL_APPS
from tests.support.factories import make_pool

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True, available_apps=POOL_APPS),
]


@pytest.fixture
def sessions() -> Iterator[Any]:
    """Open raw sessions (own transactions, a 5 s lock bound); all closed at the end."""
    opened: list[psycopg.Connection[Any]] = []
    params = connections["default"].get_connection_params()
    kept = {k: v for k, v in params.items() if k not in {"cursor_factory", "context"}}

    def session() -> psycopg.Connection[Any]:
        conn = psycopg.connect(**kept)
        conn.execute("SET lock_timeout = '5s'")
        conn.commit()
        opened.append(conn)
        return conn

    yield session
    for conn in opened:
        conn.close()


def owe(conn: psycopg.Connection[Any], pool: int, slots: int) -> None:
    conn.execute(f"SELECT {functions.name('owe')}(%s, %s)", [pool, slots])


def take(conn: psycopg.Connection[Any], pool: int) -> None:
    """What a holder does: lock the pool, admit (taking the owed work it may take)."""
    conn.execute("SELECT 1 FROM pools_pool WHERE id = %s FOR NO KEY UPDATE", [pool])
    conn.execute(
        f"SELECT * FROM {functions.name('admit')}(%s, %s, 30, false)",
        [[pool], datetime.now(UTC)],
    )


def pending(pool: int) -> tuple[int, int]:
    """(slots owed, rows pending) of ``pool``, as committed."""
    rows = OwedWork.objects.filter(pool_id=pool, pending=True)
    return sum(rows.values_list("slots", flat=True)), rows.count()


def test_owed_in_place__a_holder_leaves_a_row_being_written_to_its_writer(sessions: Any) -> None:
    """Rows 0 and 1 hold releases committed before the holder came; a call in flight is
    adding to row 1. The holder takes row 0 without waiting, leaves row 1, and all of row
    1 is still owed after its writer commits (its look after the commit takes it)."""
    pool = make_pool("p", 4)
    Pool.objects.filter(pk=pool.pk).update(held=4)
    OwedWork.objects.bulk_create(
        [
            OwedWork(pool_id=pool.pk, slot=0, slots=1, pending=True),
            OwedWork(pool_id=pool.pk, slot=1, slots=1, pending=True),
        ]
    )
    writer, holder = sessions(), sessions()
    writer.execute(
        "UPDATE pools_owedwork SET slots = slots + 2, pending = true"
        " WHERE pool_id = %s AND slot = 1",
        [pool.pk],
    )
    take(holder, pool.pk)  # returns at once (SKIP LOCKED), though the writer holds row 1
    holder.commit()
    assert Pool.objects.get(pk=pool.pk).held == 3, "row 0's release was taken"
    assert pending(pool.pk) == (1, 1), "row 1 was left to its writer"
    writer.commit()
    assert pending(pool.pk) == (3, 1), "row 1's releases are still owed, not lost"
    take(holder, pool.pk)  # what the writer's own look after its commit does
    holder.commit()
    assert Pool.objects.get(pk=pool.pk).held == 0
    assert pending(pool.pk) == (0, 0)


def test_owed_in_place__calls_leaving_work_at_once_do_not_wait_for_each_other(
    sessions: Any,
) -> None:
    """Once a pool has its 16 rows, 16 calls in flight together each find one of their own
    (a wait would end in the sessions' 5 s lock timeout)."""
    pool = make_pool("p", 16)
    Pool.objects.filter(pk=pool.pk).update(held=16)
    OwedWork.objects.bulk_create([OwedWork(pool_id=pool.pk, slot=s) for s in range(16)])
    # Two of them on the same slot by their backend's pid (20 sessions: some pair shares
    # one), so that calls preferring the same row are among them.
    opened = [sessions() for _ in range(20)]
    by_slot: dict[int, list[Any]] = {}
    for conn in opened:
        by_slot.setdefault(conn.info.backend_pid % 16, []).append(conn)
    pair = next(conns[:2] for conns in by_slot.values() if len(conns) > 1)
    writers = pair + [c for c in opened if c not in pair][:14]
    for conn in writers:
        owe(conn, pool.pk, 1)
    for conn in writers:
        conn.commit()
    assert pending(pool.pk) == (16, 16)
    holder = sessions()
    take(holder, pool.pk)
    holder.commit()
    assert Pool.objects.get(pk=pool.pk).held == 0
    assert pending(pool.pk) == (0, 0)


def test_owed_in_place__the_rows_stay_at_most_sixteen_per_pool(sessions: Any) -> None:
    """400 calls from 12 to 16 sessions, 12 in flight at a time: the pool keeps at most 16
    rows (the calls update them in place), and what they owe adds up. The sessions in
    flight together have different slots (backend pid mod 16): two on one slot with no
    committed row to take would wait for each other's commit, which this schedule holds
    back until every call of the batch has run (a CI run's pids collided so, 2026-12-06)."""
    pool = make_pool("p", 1)
    Pool.objects.filter(pk=pool.pk).update(held=1)
    by_slot: dict[int, Any] = {}
    for _ in range(48):
        conn = sessions()
        by_slot.setdefault(conn.info.backend_pid % 16, conn)
        if len(by_slot) == 16:
            break
    assert len(by_slot) >= 12, "too few distinct slots among the sessions"
    distinct = list(by_slot.values())
    for round_ in range(400 // 12):
        batch = [distinct[(round_ * 12 + i) % len(distinct)] for i in range(12)]
        for conn in batch:
            owe(conn, pool.pk, 0)
        for conn in batch:
            conn.commit()
    last = distinct[0]
    owe(last, pool.pk, 1)  # and one release among the passes
    last.commit()
    rows = OwedWork.objects.filter(pool_id=pool.pk).count()
    assert 1 <= rows <= 16, rows
    assert pending(pool.pk)[0] == 1
