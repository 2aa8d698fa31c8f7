"""Pooling changes nothing but the concurrency: what plain Celery does, a pooled task does.

Real prefork workers on Redis against PostgreSQL. Each test names the plain-Celery
behaviour it checks; Celery's own suites are compared in full by ``tests/peer``.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any, cast

import pytest
from celery.exceptions import TaskRevokedError
from celery.result import AsyncResult

from pools.models import QueueEntry
from pools.states import EntryState
from tests.acceptance.conftest import WORKER_TEST_MARKS, StartWorkers, Worker, wait_for
from tests.testapp.tasks import echo_request, reject_once, spawn_children, stamp_time

pytestmark = WORKER_TEST_MARKS

TIMEOUT = 60


@pytest.fixture
def worker(celery_workers: StartWorkers) -> list[Worker]:
    return celery_workers(count=1, concurrency=2)


def test_countdown__a_delayed_call_does_not_hold_up_calls_sent_after_it(
    worker: list[Worker],
) -> None:
    # partner-api has 1 slot. Plain Celery runs the five later calls at once; so must we.
    delayed = stamp_time.apply_async(countdown=8)
    sent = time.time()
    later = [stamp_time.delay() for _ in range(5)]
    ran = [r.get(timeout=TIMEOUT) for r in later]
    assert max(ran) - sent < 6, "the calls behind a countdown ran before it was due"
    assert delayed.get(timeout=TIMEOUT) >= sent + 8 - 0.5, "and the countdown was kept"


def test_request__the_body_sees_eta_expires_and_ids_as_plain_celery_sets_them(
    worker: list[Worker],
) -> None:
    before = datetime.now(UTC)
    result = echo_request.apply_async(
        ("x",), countdown=1, expires=600, headers={"custom_header": "kept"}
    )
    seen = result.get(timeout=TIMEOUT)
    eta = datetime.fromisoformat(seen["eta"])
    assert 0.5 < (eta - before).total_seconds() < 5, "request.eta is the ETA of the call"
    assert seen["expires"] is not None
    assert seen["retries"] == 0
    assert seen["root_id"] == result.id and seen["parent_id"] is None
    assert seen["correlation_id"] == result.id
    assert seen["reply_to"], "reply_to is the caller's, as Celery sets it"
    assert seen["stamped"] == "kept"


def test_arguments__bytes_arrive_unchanged(worker: list[Worker]) -> None:
    seen = echo_request.delay(b"\x00\xffraw").get(timeout=TIMEOUT)
    assert (seen["type"], seen["value"]) == ("bytes", repr(b"\x00\xffraw"))


def test_expires__passing_while_waiting_revokes_it_as_celery_does(worker: list[Worker]) -> None:
    from pools.core import admission, capacity

    capacity.set_paused("partner-api", True)  # keeps the call waiting past its expiry
    try:
        short = echo_request.apply_async(("late",), expires=0.5)
        time.sleep(1)
        assert admission.expire_due(datetime.now(UTC)) == 1  # what the sweep runs
        entry = QueueEntry.objects.get(key=short.id)
        assert (entry.state, entry.reason) == (EntryState.EXPIRED, "expired")
        with pytest.raises(TaskRevokedError, match="expired"):
            short.get(timeout=TIMEOUT)
    finally:
        capacity.set_paused("partner-api", False)


def test_children__a_body_that_calls_pooled_tasks_gets_exactly_their_results(
    worker: list[Worker],
) -> None:
    # A call admitted at once from inside a body is published by the gate; the publish
    # must not add a second result to the calling task's children (it broke Celery's
    # test_chord_on_error: the errback's bare result took the place of its group).
    result = spawn_children.delay(3)
    trail = result.get(timeout=TIMEOUT)
    assert len(trail) == 3 and len(set(trail)) == 3
    # celery-types types children as tuples; at run time they are the AsyncResults.
    children = cast("list[AsyncResult[Any]]", result.children)
    assert [c.id for c in children] == trail


def test_reject_with_requeue__the_redelivered_message_runs_under_the_same_claim(
    worker: list[Worker],
) -> None:
    # Plain Celery redelivers a message whose task raised Reject(requeue=True), marked
    # ``redelivered``; the claim stays valid for that delivery.
    result = reject_once.delay()
    assert result.get(timeout=TIMEOUT) == "second time"
    entry = wait_for(
        lambda: QueueEntry.objects.filter(key=result.id, state=EntryState.SUCCEEDED).first(),
        30,
        "the entry to settle (after the result is stored)",
    )
    assert QueueEntry.objects.filter(key=result.id).count() == 1
    assert entry.token == 1, "the redelivery ran under the claim of the first admission"
