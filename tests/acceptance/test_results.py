"""Entries that end while waiting become Celery results (SPEC §4 "Results"), on real workers.

An expired entry is a FAILURE carrying ``QueueTimeout``, a cancelled or revoked one is
REVOKED; both call ``link_error`` and fail a chord they belong to, so nothing waits on
them forever. A holder task keeps the 1-slot pool busy so the entries under test wait.
These tests do not depend on lease timing (default lease); sweeps run in this process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from celery import chord
from celery.exceptions import ChordError, TaskRevokedError
from celery.result import AsyncResult
from django.utils import timezone

import pools
from pools import QueueTimeout, testing
from pools.models import Demand, Pool, QueueEntry
from pools.states import EntryState
from tests.acceptance import faults_support
from tests.acceptance.conftest import WORKER_TEST_MARKS, StartWorkers
from tests.acceptance.faults_support import read_notes, wait_for, wait_notes
from tests.testapp.fault_tasks import (
    RESULTS_POOL,
    collect,
    hold_results_pool,
    note_errback,
    note_errback_inline,
    plain_echo,
    queued_member,
)

pytestmark = WORKER_TEST_MARKS

shared_dir = faults_support.shared_dir

TIMEOUT = 30
#: ``pool_options`` of the entries that must expire.
QUEUE_TIMEOUT = 2


@dataclass
class Holder:
    """A running task holding the 1-slot pool until :meth:`release`."""

    result: AsyncResult
    where: Path

    def release(self) -> None:
        (self.where / "release-h").touch()
        assert self.result.get(timeout=TIMEOUT) == "h"
        wait_for(
            lambda: QueueEntry.objects.filter(
                key=self.result.id, state=EntryState.SUCCEEDED
            ).exists(),
            TIMEOUT,
            "the holder to settle",
        )


@pytest.fixture
def holder(celery_workers: StartWorkers, shared_dir: Path) -> Holder:
    """One worker, a 1-slot pool, and a running task holding it."""
    Pool.objects.create(name=RESULTS_POOL, slots=1)
    celery_workers(count=1, concurrency=2)
    result = hold_results_pool.delay(str(shared_dir), "h")
    wait_notes(shared_dir, "holder", lambda ns: len(ns) == 1, TIMEOUT, "the holder to start")
    return Holder(result=result, where=shared_dir)


def wait_past_deadline(key: str) -> None:
    deadline = QueueEntry.objects.get(key=key).deadline
    assert deadline is not None
    time.sleep(max((deadline - timezone.now()).total_seconds(), 0) + 0.05)


def errbacks(where: Path, expected: set[str]) -> list[dict]:
    """Wait until the worker ran ``note_errback`` for each id in ``expected``."""
    notes = wait_notes(
        where,
        "errbacks",
        lambda ns: {n["task_id"] for n in ns} >= expected,
        TIMEOUT,
        f"link_error callbacks for {sorted(expected)}",
    )
    return notes


def never_started(*keys: str) -> None:
    """Never admitted nor started (the entries carry those transitions)."""
    assert (
        not QueueEntry.objects.filter(key__in=keys)
        .exclude(admitted_at__isnull=True, started_at__isnull=True)
        .exists()
    )


def test_results__expired_entry_fails_with_queue_timeout_and_calls_link_error(
    holder: Holder, shared_dir: Path
) -> None:
    where = str(shared_dir)
    waiter = queued_member.apply_async(  # type: ignore[call-arg]  # celery-types: no **options
        (where, 1),
        pool_options={"queue_timeout": QUEUE_TIMEOUT},
        link_error=[note_errback.s(where=where), note_errback_inline.s(where=where)],
    )
    entry = QueueEntry.objects.get(key=waiter.id)
    assert entry.state == EntryState.WAITING and entry.deadline is not None
    assert testing.sweep().expired == 0, "expired before its deadline"
    assert waiter.state == "PENDING"

    wait_past_deadline(waiter.id)
    assert testing.sweep().expired == 1
    entry.refresh_from_db()
    assert (entry.state, entry.reason) == (EntryState.EXPIRED, "queue_timeout")

    assert waiter.state == "FAILURE"
    with pytest.raises(QueueTimeout) as info:
        waiter.get(timeout=TIMEOUT, propagate=True)
    assert info.value.pool == RESULTS_POOL
    # link_error: the classic errback ran on the worker with the failed task's id, the
    # (request, exc, traceback) one in the sweeping process with the QueueTimeout itself.
    (classic,) = errbacks(shared_dir, {waiter.id})
    assert classic["hostname"]
    (inline,) = read_notes(shared_dir, "inline-errbacks")
    assert (inline["task_id"], inline["exc_type"]) == (waiter.id, "QueueTimeout")

    holder.release()
    never_started(waiter.id)
    assert read_notes(shared_dir, "members") == []


def test_results__cancelled_or_revoked_waiting_entry_is_revoked_and_calls_link_error(
    holder: Holder, shared_dir: Path
) -> None:
    where = str(shared_dir)
    cancelled = queued_member.apply_async((where, 1), link_error=note_errback.s(where=where))
    revoked = queued_member.apply_async((where, 2), link_error=note_errback.s(where=where))
    assert set(
        QueueEntry.objects.filter(key__in=[cancelled.id, revoked.id]).values_list(
            "state", flat=True
        )
    ) == {EntryState.WAITING}

    entry = pools.cancel(cancelled.id)
    assert entry.state == EntryState.CANCELLED
    assert cancelled.state == "REVOKED"
    with pytest.raises(TaskRevokedError):
        cancelled.get(timeout=TIMEOUT)

    AsyncResult(revoked.id).revoke()
    assert QueueEntry.objects.get(key=revoked.id).state == EntryState.CANCELLED
    assert AsyncResult(revoked.id).state == "REVOKED"
    with pytest.raises(TaskRevokedError):
        revoked.get(timeout=TIMEOUT)

    notes = errbacks(shared_dir, {cancelled.id, revoked.id})
    assert sorted(n["task_id"] for n in notes) == sorted([cancelled.id, revoked.id])

    # Releasing the pool admits nothing of them: they left the line for good.
    holder.release()
    never_started(cancelled.id, revoked.id)
    assert read_notes(shared_dir, "members") == []
    pool = Pool.objects.get(name=RESULTS_POOL)
    assert Demand.objects.held_slots(pool.pk) == 0


def test_results__chord_with_an_expired_header_member_fails_instead_of_hanging(
    holder: Holder, shared_dir: Path
) -> None:
    where = str(shared_dir)
    member = queued_member.s(where, 1).set(
        pool_options={"queue_timeout": QUEUE_TIMEOUT}  # type: ignore[call-arg]  # as above
    )
    result = chord([member, plain_echo.s(2)], collect.s()).apply_async()
    (entry,) = QueueEntry.objects.filter(task_name=queued_member.name)
    assert entry.state == EntryState.WAITING

    wait_past_deadline(entry.key)
    assert testing.sweep().expired == 1
    # As in plain Celery, the chord's result re-raises the failed header member's error...
    with pytest.raises(QueueTimeout):
        result.get(timeout=TIMEOUT)
    assert AsyncResult(entry.key).state == "FAILURE"
    # ...and the body itself was resolved as failed (ChordError naming the member), so a
    # waiter on the body alone (no parent to re-raise from) does not hang either.
    with pytest.raises(ChordError) as info:
        AsyncResult(result.id).get(timeout=TIMEOUT)
    assert entry.key in str(info.value) and "QueueTimeout" in str(info.value)

    holder.release()
    never_started(entry.key)
