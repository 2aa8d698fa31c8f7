"""Through PgBouncer 1.18 in transaction mode (``make test-pgbouncer``), with real workers.

The other acceptance tests of the tier run unchanged through it; these show that they
do: the test database's connections really are PgBouncer's (transaction mode, server
connections in use), and the tier reproduces the failure it guards against — workers
whose own connection prepares statements fail their pooled tasks through it.
"""

from __future__ import annotations

import time

import pytest

from pools.models import Pool
from tests.acceptance.conftest import WORKER_TEST_MARKS, StartWorkers
from tests.support import pgbouncer
from tests.testapp.tasks import ACCEPT_POOL, span

pytestmark = [*WORKER_TEST_MARKS, pytest.mark.postgres, pytest.mark.pgbouncer]

RESULT_TIMEOUT = 120.0
CALLS = 40


def _test_database() -> str:
    from django.db import connection

    return str(connection.settings_dict["NAME"])


def test_pgbouncer__the_tier_runs_through_it_in_transaction_mode(
    celery_workers: StartWorkers,
) -> None:
    celery_workers(count=1, concurrency=4)
    Pool.objects.create(name=ACCEPT_POOL, slots=2)
    results = [span.delay(i, 0.01) for i in range(CALLS)]
    assert sorted(r.get(timeout=RESULT_TIMEOUT)["i"] for r in results) == list(range(CALLS))
    assert pgbouncer.setting("pool_mode") == "transaction"
    version = pgbouncer.admin("SHOW VERSION")[0]
    print(f"\n{next(iter(version.values()))}")
    pools = [p for p in pgbouncer.admin("SHOW POOLS") if p["database"] == _test_database()]
    assert pools and pools[0]["pool_mode"] == "transaction"
    assert pools[0]["cl_active"] + pools[0]["cl_waiting"] >= 2  # this process and workers
    stats = [s for s in pgbouncer.admin("SHOW STATS") if s["database"] == _test_database()]
    assert stats and stats[0]["total_xact_count"] >= CALLS


def test_pgbouncer__sabotage_prepared_statements_break_pooled_tasks(
    celery_workers: StartWorkers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers that prepare statements on pools' own connection (as before
    ``prepare_threshold=None`` was honoured) break through PgBouncer: a statement prepared
    by one client is found, or missing, on the server connection the next client gets
    (``prepared statement "_pg3_0" already exists``, ``... does not exist``, or ``bind
    message supplies 7 parameters, but prepared statement "_pg3_0" requires 9``, which
    makes a start retry for ever)."""
    monkeypatch.setenv("POOLS_TEST_PREPARED_STATEMENTS", "1")
    workers = celery_workers(count=1, concurrency=4, allow_errors=True)
    Pool.objects.create(name=ACCEPT_POOL, slots=4)
    # The clash needs two clients that each prepared a statement (psycopg prepares a query
    # on its fifth run) to meet on one server connection: bodies long enough that the four
    # children run side by side, and more calls until one does (a lone child, as a CI run
    # once had, can run 40 calls on one server connection without a clash).
    sent: list = []
    deadline = time.monotonic() + RESULT_TIMEOUT
    while 'prepared statement "_pg3_' not in workers[0].log_text():
        if time.monotonic() > deadline:
            pytest.fail(
                f"timed out after {RESULT_TIMEOUT:.0f}s ({len(sent)} calls) waiting for a "
                "worker to log a prepared statement error"
            )
        sent.extend(span.delay(len(sent) + i, 0.05) for i in range(CALLS))
        batch_end = time.monotonic() + 5.0
        while (
            time.monotonic() < batch_end
            and 'prepared statement "_pg3_' not in workers[0].log_text()
        ):
            time.sleep(0.1)
    for r in sent:
        r.forget()
