"""Backoff with real prefork workers (PostgreSQL + Redis; docs/howto/backoff.md): a body that
answers 429 once backs off and succeeds on its second attempt; while its pool backs off a
second call does not start (an independent log of body starts); past the limit the task
fails.

Sabotage run (recorded in docs/howto/backoff.md, "How it is tested"): with
``pools.core.backoffs._pause`` setting ``backoff_until`` but not ``paused``, the first test
fails at ``assert all(r["start"] >= until.timestamp() ...)``: the first call runs again at
once and the second one right after it, both inside the pause. (With ``_pause`` a no-op it
fails earlier, waiting for a backoff that never shows.)
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from pools.exceptions import BackoffLimitExceeded
from pools.models import Pool, QueueEntry
from tests.acceptance.conftest import WORKER_TEST_MARKS, wait_for
from tests.support.factories import make_pool
from tests.testapp import tasks

pytestmark = WORKER_TEST_MARKS

partner_call: Any = tasks.partner_call

TIMEOUT = 60
PAUSE = 4.0


def starts(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def backoff_until() -> datetime | None:
    return Pool.objects.get(name=tasks.BACKOFF_POOL).backoff_until


def test_backoff__second_call_waits_for_the_pause_first_call_succeeds_on_its_second_attempt(
    celery_workers: Any, tmp_path: Path
) -> None:
    # One slot, given back by the backoff: during the pause only the pause holds the line
    # (without it the first call runs again at once, then the second: both before its end).
    make_pool(tasks.BACKOFF_POOL, 1)
    celery_workers(count=2, concurrency=2)
    log = tmp_path / "starts.jsonl"
    log.touch()
    first = partner_call.delay(str(log), "first", 1, PAUSE)
    until = wait_for(backoff_until, TIMEOUT, "the pool's backoff")
    second = partner_call.delay(str(log), "second", 0, PAUSE)
    entry = wait_for(lambda: QueueEntry.objects.filter(key=second.id).first(), TIMEOUT, "entry")
    # The second call was put in line while the pool backed off (else the test proves nothing).
    assert entry.enqueued_at < until
    assert first.state == "PENDING"  # a backoff is not a failure: no result yet
    assert first.get(timeout=TIMEOUT) == {"name": "first", "attempt": 2}
    assert second.get(timeout=TIMEOUT) == {"name": "second", "attempt": 1}
    log_rows = starts(log)
    assert [r["name"] for r in log_rows] == ["first", "first", "second"]
    # Nothing started during the pause: both later starts are at or after its end.
    assert all(r["start"] >= until.timestamp() for r in log_rows[1:])
    done = wait_for(
        lambda: QueueEntry.objects.filter(key=first.id, state="succeeded").first(),
        TIMEOUT,
        "the first entry settled",
    )
    assert done.backoffs == 1
    wait_for(
        lambda: QueueEntry.objects.filter(key=second.id, state="succeeded").exists(),
        TIMEOUT,
        "second settled",
    )
    pool = Pool.objects.get(name=tasks.BACKOFF_POOL)
    assert (pool.paused, pool.backoff_until, pool.backoffs, pool.held) == (False, None, 1, 0)


def test_backoff__past_max_backoffs_the_task_fails(celery_workers: Any, tmp_path: Path) -> None:
    make_pool(tasks.BACKOFF_POOL, 1)
    celery_workers(count=1, concurrency=2, allow_errors=True)  # the failure is logged
    log = tmp_path / "starts.jsonl"
    log.touch()
    result = partner_call.delay(str(log), "stubborn", 99, 1.0)  # max_backoffs=2
    with pytest.raises(BackoffLimitExceeded, match="backed off 2 times"):
        result.get(timeout=TIMEOUT)
    assert result.state == "FAILURE"
    assert len(starts(log)) == 3  # two backoffs, then the third answer fails it
    entry = wait_for(  # settled after the result is stored (task_postrun)
        lambda: QueueEntry.objects.filter(key=result.id, state="failed").first(),
        TIMEOUT,
        "the entry settled failed",
    )
    assert entry.backoffs == 2
    assert Pool.objects.get(name=tasks.BACKOFF_POOL).held == 0
