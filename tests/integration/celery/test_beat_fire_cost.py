"""What a beat fire costs beat (single-threaded): at most one short transaction, never a
wait on pool locks past ``LOCK_TIMEOUT_SECONDS`` (PostgreSQL: real row locks)."""

from __future__ import annotations

import logging
import re
import time

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from pytest_django import Settings

from pools.core.supersession import waiting_of_job
from pools.models import QueueEntry
from pools.pg import functions
from tests.conftest import POOL_APPS
from tests.integration.core.test_locking import (
    _plan_without_seqscan,
    pool_row_locked,
    with_pools_option,
)
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool
from tests.testapp.tasks import add, skip_job

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True, available_apps=POOL_APPS),
]

FIRE = {"periodic_task_name": "skipper"}


#: A pool row lock: ``FOR UPDATE``, or ``FOR NO KEY UPDATE`` on PostgreSQL, of rows read
#: from the pool table (not the take of owed work, which locks rows of its own table).
LOCKS = re.compile(r'FROM "?pools_pool"? .*FOR (NO KEY )?UPDATE', re.S)


def locked_statements(queries: CaptureQueriesContext) -> int:
    """Transactions that took pool row locks (each starts with one ``FOR UPDATE``, on
    PostgreSQL ``FOR NO KEY UPDATE``)."""
    return sum(bool(LOCKS.search(q["sql"])) for q in queries.captured_queries)


@pytest.mark.parametrize("task", [add, skip_job], ids=["allow", "skip"])
def test_beat_fire__one_locked_transaction(
    recorder: RecordingBridge, admission_path: str, task: object
) -> None:
    make_pool("warehouse", 1)
    with CaptureQueriesContext(connection) as queries:
        skip_job.apply_async(headers=FIRE) if task is skip_job else add.apply_async(
            (1, 2), headers=FIRE
        )
    sql = [q["sql"] for q in queries.captured_queries]
    assert locked_statements(queries) == 1
    assert sql.count("BEGIN") == sql.count("COMMIT") == 1  # one transaction
    outside = sql[: sql.index("BEGIN")] + sql[sql.index("COMMIT") + 1 :]
    # After the commit, on the PostgreSQL engine: the look for work that calls which found
    # the pool locked left to this holder (docs/concepts/admission.md#contention).
    looks = [q for q in outside if q.startswith(f"CALL {functions.name('recheck')}(")]
    assert len(looks) == (1 if admission_path == "sql" else 0), outside
    # Otherwise at most the key's look-up (skip): one indexed SELECT, no lock.
    others = [q for q in outside if q not in looks]
    assert len(others) <= (1 if task is skip_job else 0), others


def test_skipped_fire__takes_no_lock_at_all(
    recorder: RecordingBridge, admission_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    make_pool("warehouse", 1)
    first = skip_job.apply_async(headers=FIRE)
    with CaptureQueriesContext(connection) as queries, caplog.at_level(logging.WARNING):
        assert skip_job.apply_async(headers=FIRE).id == first.id
    assert locked_statements(queries) == 0
    assert len(queries.captured_queries) == 1  # the idempotency key's look-up


def test_beat_fire__waits_no_longer_than_the_bound_then_is_dropped_with_one_warning(
    recorder: RecordingBridge,
    settings: Settings,
    admission_path: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with_pools_option(settings, LOCK_TIMEOUT_SECONDS=0.5)
    make_pool("warehouse", 1)
    with pool_row_locked("warehouse"), caplog.at_level(logging.WARNING, logger="pools"):
        began = time.monotonic()
        skip_job.apply_async(headers=FIRE)  # dropped: beat goes on
        waited = time.monotonic() - began
    assert 0.4 <= waited < 5, f"waited {waited:.2f}s for a 0.5s lock timeout"
    lines = [r.getMessage() for r in caplog.records if r.name == "pools"]
    assert len(lines) == 1 and lines[0].startswith(
        "Job skipper could not enter pool warehouse: pool state is unavailable"
    ), lines
    assert not QueueEntry.objects.exists()


def test_job_queries__are_served_by_the_job_index(recorder: RecordingBridge) -> None:
    for queryset in (waiting_of_job("nightly"), waiting_of_job("nightly", retries_only=True)):
        assert "pools_entry_job" in _plan_without_seqscan(queryset)
    by_key = QueueEntry.objects.filter(idempotency_active="order-42")
    assert "pools_entry_idempotency_active" in _plan_without_seqscan(by_key)
