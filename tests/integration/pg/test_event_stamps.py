"""The times the database records are each call's clock, read before it waited for the
pools' locks: an admission that waited behind the requeue it follows carries the earlier
stamp. The tokens keep the true order, and the chaos checker reads an entry's own
transitions by them (:func:`tests.chaos.check.stamp_skews`). Found by a chaos run in CI
(seed 34: a head "waiting with free slots for inf ms", 2026-12-06).
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
from django.db import connection, connections

from pools.core import admission, locking
from pools.models import PoolEvent, QueueEntry
from pools.states import EntryState, EventKind
from tests.chaos.check import recorded, stamp_skews, starved_heads
from tests.conftest import POOL_APPS
from tests.support.factories import make_pool, submit

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True, available_apps=POOL_APPS),
]


def waits_for_a_lock() -> None:
    """Until another session of this database waits for a lock (10 s at most)."""
    deadline = time.monotonic() + 10
    with connection.cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
            )
            if cursor.fetchone()[0]:
                return
            time.sleep(0.01)
    raise AssertionError("no session waited for a lock")


def test_event_stamps__a_readmission_behind_its_requeue_is_stamped_before_it() -> None:
    """Pool ``c`` (2 slots) holds entry A and a multi-pool entry M (``a`` and ``c``), and a
    higher-priority entry waits. M's settle reads its clock, then waits for pool ``a``
    (held by another pass). Meanwhile A's lease lapses: its requeue takes ``c``, gives
    A's slot to the waiting entry, and commits. When ``a`` is free, M's settle frees its
    slot in ``c`` and admits A, stamped with the clock it read before the requeue."""
    make_pool("a", 1)
    make_pool("c", 2)
    first = QueueEntry.objects.get(pk=submit("c").entry_id)
    multi = QueueEntry.objects.get(pk=submit({"a": 1, "c": 1}).entry_id)
    assert {first.state, multi.state} == {EntryState.ADMITTED}
    submit("c", priority=10)
    locked, release = threading.Event(), threading.Event()
    settled: list[bool] = []

    def hold_a() -> None:
        try:
            with locking.locked_pools(["a"]):
                locked.set()
                release.wait(10)
        finally:
            connections.close_all()

    def settle_multi() -> None:
        try:
            settled.append(admission.settle(multi.queue_id, multi.token, "success"))
        finally:
            connections.close_all()

    holder, settler = threading.Thread(target=hold_a), threading.Thread(target=settle_multi)
    holder.start()
    assert locked.wait(10)
    settler.start()
    waits_for_a_lock()  # the settle has read its clock and waits for pool "a"
    assert admission.requeue(first.queue_id, first.token, reason="lease lapsed")
    release.set()
    holder.join(10)
    settler.join(10)
    assert settled == [True]

    first.refresh_from_db()
    requeued = PoolEvent.objects.get(entry_id=first.queue_id, kind=EventKind.REQUEUED)
    assert first.state == EntryState.ADMITTED
    assert requeued.token is not None
    assert first.token == requeued.token + 1  # admitted after the requeue...
    assert first.admitted_at is not None and first.admitted_at < requeued.at  # ...stamped before

    stream, waiters = recorded(QueueEntry.objects.all(), PoolEvent.objects.order_by("id"))
    assert stamp_skews(stream) == [first.queue_id]
    assert starved_heads(stream, waiters, {"a": 1, "c": 2}) == []
    # Read by its stamps alone, A went back in line at the requeue and never left it.
    by_stamps = [replace(t, token=0) for t in stream]
    assert float("inf") in [e.seconds for e in starved_heads(by_stamps, waiters, {"a": 1, "c": 2})]
