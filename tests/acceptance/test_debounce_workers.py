"""Debounce with real workers (PostgreSQL + Redis): a burst of calls with one key runs the
body once, with the last call's arguments, and every caller's ``AsyncResult.get()`` returns
that run's result (docs/howto/debounce.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pools.models import QueueEntry
from tests.acceptance.conftest import WORKER_TEST_MARKS
from tests.support.factories import make_pool
from tests.testapp import tasks

pytestmark = WORKER_TEST_MARKS

debounced_refresh: Any = tasks.debounced_refresh

BURST = 12
TIMEOUT = 60


def test_burst__one_body_run_with_the_last_arguments_every_result_is_its(
    celery_workers: Any, tmp_path: Path
) -> None:
    celery_workers(count=2, concurrency=2)
    make_pool("warehouse", 2)
    log = tmp_path / "runs.jsonl"
    burst = [debounced_refresh.delay(str(log), "acme", i) for i in range(BURST)]
    other = debounced_refresh.delay(str(log), "globex", 99)  # another key: its own run
    got = [r.get(timeout=TIMEOUT) for r in burst]
    assert got == [{"tenant": "acme", "x": BURST - 1}] * BURST
    assert other.get(timeout=TIMEOUT) == {"tenant": "globex", "x": 99}
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted((r["tenant"], r["x"]) for r in runs) == [("acme", BURST - 1), ("globex", 99)]
    assert QueueEntry.objects.filter(debounce_key="refresh-acme").count() == 1


def test_failed_run__every_collapsed_call_raises_its_exception(
    celery_workers: Any, tmp_path: Path
) -> None:
    celery_workers(count=1, concurrency=2, allow_errors=True)  # the body fails on purpose
    make_pool("warehouse", 2)
    log = tmp_path / "runs.jsonl"
    burst = [debounced_refresh.delay(str(log), "initech", x) for x in (1, 2, -3)]
    for result in burst:
        with pytest.raises(ValueError, match="refused x=-3"):
            result.get(timeout=TIMEOUT)
    assert [r.state for r in burst] == ["FAILURE"] * 3
    assert len(log.read_text().splitlines()) == 1
