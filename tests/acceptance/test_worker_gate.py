"""Worker side of the gate: a pooled body runs only under a valid, unused claim.

The task ``noted`` appends one line per body execution to a file, so the tests count
executions directly instead of trusting the event log alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from celery.result import AsyncResult
from celery.utils import uuid

from pools.celery import originals
from pools.celery.messages import CLAIM_HEADER
from pools.core import events as pool_events
from pools.models import PoolEvent, QueueEntry
from pools.states import EntryState, EventKind, Origin
from tests.acceptance.conftest import WORKER_TEST_MARKS, StartWorkers, wait_for
from tests.acceptance.faults_support import max_overlap
from tests.celery_app import app
from tests.support.bridge import RecordingBridge
from tests.testapp.tasks import noted, noted_slowly

pytestmark = WORKER_TEST_MARKS

TIMEOUT = 60


def events(key: str, kind: str) -> list[PoolEvent]:
    """The key's events of one kind, from the stream (logged rows and what entries carry).

    A normal transition appears once per entry (the entry carries its last one); the body
    runs recorded by the task itself (``runs``) count the executions.
    """
    logged = PoolEvent.objects.filter(key=key).order_by("id")
    stream = pool_events.stream(QueueEntry.objects.filter(key=key), logged)
    return [e for e in stream if e.kind == kind]


def runs(path: Path) -> list[dict]:
    """One item per execution of the body of ``noted`` that wrote to ``path``."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def send_around_gate(name: str, args: list[Any], **options: Any) -> AsyncResult[Any]:
    """Publish with Celery's own ``send_task``, as a process without the gate would."""
    result: AsyncResult[Any] = originals.send_task(app, name, args, {}, **options)
    return result


def wait_settled(key: str) -> QueueEntry:
    def done() -> QueueEntry | None:
        entry = QueueEntry.objects.filter(key=key).order_by("-queue_id").first()
        return entry if entry is not None and entry.is_terminal else None

    entry: QueueEntry = wait_for(done, 30, f"entry {key} to settle")
    return entry


def test_worker__message_without_claim_is_put_in_line_then_run_once(
    celery_workers: StartWorkers, tmp_path: Path
) -> None:
    workers = celery_workers(count=2, concurrency=2)
    path = tmp_path / "runs.jsonl"
    key = uuid()
    result = send_around_gate(noted.name, [str(path), 2, 3], task_id=key)
    assert result.id == key
    assert result.get(timeout=TIMEOUT) == 5

    entry = wait_settled(key)
    assert entry.state == EntryState.SUCCEEDED
    assert QueueEntry.objects.filter(key=key).count() == 1, "the delivery became one entry"
    assert entry.origin == Origin.UNGATED
    assert len(events(key, EventKind.ENQUEUED)) == 1
    assert len(events(key, EventKind.ADMITTED)) == 1
    started = events(key, EventKind.STARTED)
    assert len(started) == 1, "the body started exactly once"
    assert started[0].token == entry.token
    # The body ran once, and under the entry's claim (never for the claimless delivery).
    assert [r["token"] for r in runs(path)] == [entry.token]
    intercepted = [w for w in workers if f"[{key}] arrived without a pool claim" in w.log_text()]
    assert len(intercepted) == 1, "exactly one worker intercepted the claimless delivery"


def test_worker__duplicate_delivery_of_admitted_message_runs_body_once(
    celery_workers: StartWorkers, recorder: RecordingBridge, tmp_path: Path
) -> None:
    workers = celery_workers(count=2, concurrency=2)
    path = tmp_path / "runs.jsonl"
    # The test process records admissions instead of publishing them, so the entry is
    # admitted (slots held, token issued) and the test publishes its message itself.
    result = noted.delay(str(path), 20, 22)
    (admitted,) = recorder.admissions
    assert admitted.key == result.id
    assert QueueEntry.objects.get(key=result.id).state == EntryState.ADMITTED

    headers = {CLAIM_HEADER: f"{admitted.entry_id}:{admitted.token}"}
    for _ in range(2):  # the same message twice, back to back (two workers may race)
        send_around_gate(noted.name, list(admitted.args), task_id=admitted.key, headers=headers)

    assert result.get(timeout=TIMEOUT) == 42
    assert wait_settled(result.id).state == EntryState.SUCCEEDED
    skipped = wait_for(
        lambda: events(result.id, EventKind.SKIPPED), 30, "the duplicate delivery to be skipped"
    )
    assert len(skipped) == 1
    assert skipped[0].token == admitted.token
    started = events(result.id, EventKind.STARTED)
    assert len(started) == 1, "the body started exactly once"
    assert started[0].detail["worker"] in {w.name for w in workers}
    assert len(events(result.id, EventKind.SETTLED)) == 1
    assert [r["token"] for r in runs(path)] == [admitted.token]


def test_worker__redelivery_after_settle_is_skipped(
    celery_workers: StartWorkers, tmp_path: Path
) -> None:
    """A stale claim (the entry already ran and settled) never runs the body again."""
    celery_workers(count=1, concurrency=2)
    path = tmp_path / "runs.jsonl"
    result = noted.delay(str(path), 1, 1)
    assert result.get(timeout=TIMEOUT) == 2
    entry = wait_settled(result.id)
    assert entry.state == EntryState.SUCCEEDED

    headers = {CLAIM_HEADER: f"{entry.queue_id}:{entry.token}"}
    send_around_gate(noted.name, [str(path), 1, 1], task_id=result.id, headers=headers)
    wait_for(lambda: events(result.id, EventKind.SKIPPED), 30, "the stale delivery to be skipped")
    assert len(events(result.id, EventKind.STARTED)) == 1
    assert QueueEntry.objects.get(key=result.id).state == EntryState.SUCCEEDED
    assert len(runs(path)) == 1


def _redelivered_while_the_body_runs(
    celery_workers: StartWorkers, recorder: RecordingBridge, tmp_path: Path, *, sabotage: bool
) -> list[tuple[float, float]]:
    """One admitted claim delivered to a worker and, once its body has started, delivered
    again (as the broker redelivers an unacknowledged message) to another worker. Returns
    the (start, end) of every body that ran."""
    celery_workers(count=2, concurrency=1)
    path = tmp_path / "spans.jsonl"
    result = noted_slowly.delay(str(path), 4.0, sabotage)
    (admitted,) = recorder.admissions
    headers = {CLAIM_HEADER: f"{admitted.entry_id}:{admitted.token}"}
    send_around_gate(noted_slowly.name, list(admitted.args), task_id=admitted.key, headers=headers)
    wait_for(lambda: runs(path), 30, "the first body to start")
    send_around_gate(noted_slowly.name, list(admitted.args), task_id=admitted.key, headers=headers)
    result.get(timeout=TIMEOUT)
    wait_settled(result.id)
    if not sabotage:
        wait_for(lambda: events(result.id, EventKind.SKIPPED), 30, "the duplicate to be skipped")
    else:  # both bodies end
        wait_for(lambda: len(runs(path)) == 4 or None, 30, "the second body to end")
    lines = runs(path)
    starts = {r["pid"]: r["at"] for r in lines if r["event"] == "start"}
    ends = {r["pid"]: r["at"] for r in lines if r["event"] == "end"}
    return [(starts[pid], ends.get(pid, float("inf"))) for pid in starts]


def test_worker__a_delivery_while_the_body_runs_is_skipped_by_the_fence(
    celery_workers: StartWorkers, recorder: RecordingBridge, tmp_path: Path
) -> None:
    """The fenced start writes nothing, yet a duplicate delivery never runs a second body
    at once: the first body's session holds the entry's fence (PostgreSQL)."""
    spans = _redelivered_while_the_body_runs(celery_workers, recorder, tmp_path, sabotage=False)
    assert len(spans) == 1
    assert max_overlap(spans) == 1


def test_worker__sabotage_without_the_fence_a_redelivery_runs_a_second_body_at_once(
    celery_workers: StartWorkers, recorder: RecordingBridge, tmp_path: Path
) -> None:
    """The proof above can fail: a body that drops its fence lets the duplicate run too."""
    spans = _redelivered_while_the_body_runs(celery_workers, recorder, tmp_path, sabotage=True)
    assert max_overlap(spans) == 2
