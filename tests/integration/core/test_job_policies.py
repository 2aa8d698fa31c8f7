"""Submit side of the job policies (SPEC §7): job identity, idempotency keys, skip,
replace and superseded retries, through the gate, on both admission paths."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from pools.core import admission, enqueueing
from pools.exceptions import PoolConfigurationError
from pools.models import PoolEvent, QueueEntry
from pools.states import EntryState, EventKind, Origin
from tests.conftest import POOL_APPS
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool
from tests.testapp import tasks

# celery-types' apply_async takes no **options (pool_options, retries, headers...).
add: Any = tasks.add
forbid_job: Any = tasks.forbid_job
replace_job: Any = tasks.replace_job
ship_order: Any = tasks.ship_order
skip_job: Any = tasks.skip_job

pytestmark = pytest.mark.django_db(transaction=True, available_apps=POOL_APPS)

BEAT = {"periodic_task_name": "nightly-add"}


@pytest.fixture
def paths(admission_path: str, recorder: RecordingBridge) -> RecordingBridge:
    """Both admission paths (PostgreSQL runs each test on the SQL and the ORM path)."""
    return recorder


def entries() -> list[QueueEntry]:
    return list(QueueEntry.objects.order_by("queue_id"))


def block(pool: str = "warehouse") -> str:
    """Fill the 1-slot pool with an unrelated admitted entry; later entries wait."""
    return str(add.apply_async((0, 0)).id)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"concurrency_policy": "sometimes"}, "concurrency_policy must be one of allow, forbid"),
        ({"job_key": ""}, "job_key must be a non-empty string"),
        ({"idempotency_key": 42}, "idempotency_key must be a non-empty string"),
        ({"idempotency_key": "x" * 201}, "at most 200 characters"),
    ],
)
def test_bad_policy_options__refused_with_the_fix_and_nothing_written(
    paths: RecordingBridge, options: dict[str, Any], message: str
) -> None:
    make_pool("warehouse", 1)
    with pytest.raises(PoolConfigurationError, match=message):
        add.apply_async((1, 2), pool_options=options)
    assert entries() == []


def test_bad_decorator_policy__raises_at_import() -> None:
    from pools import pooled

    with pytest.raises(PoolConfigurationError, match="concurrency_policy must be one of"):
        pooled("warehouse", concurrency_policy="once")
    with pytest.raises(PoolConfigurationError, match="job_key must be"):
        pooled("warehouse", job_key="")


def test_job_identity__stored_only_for_a_policy_a_key_or_a_beat_fire(
    paths: RecordingBridge,
) -> None:
    make_pool("warehouse", 5)
    add.apply_async((1, 1))
    add.apply_async((1, 2), pool_options={"job_key": "tenant-7"})
    add.apply_async((1, 3), pool_options={"concurrency_policy": "forbid"})
    add.apply_async((1, 4), headers=BEAT)
    add.apply_async((1, 5), headers=BEAT, pool_options={"job_key": "ignored-for-beat"})
    rows = [(e.job, e.concurrency_policy, e.origin) for e in entries()]
    assert rows == [
        ("", "allow", Origin.CODE),
        (f"{add.name}:tenant-7", "allow", Origin.CODE),
        (add.name, "forbid", Origin.CODE),
        ("nightly-add", "allow", Origin.BEAT),
        ("nightly-add", "allow", Origin.BEAT),
    ]


def test_idempotency_key__second_submit_returns_the_first_entry_and_creates_nothing(
    paths: RecordingBridge,
) -> None:
    make_pool("warehouse", 1)
    block()
    first = ship_order.delay(42)
    second = ship_order.delay(42)
    other = ship_order.delay(43)
    per_call = add.apply_async((1, 1), pool_options={"idempotency_key": "order-42"})
    assert second.id == first.id == per_call.id
    assert other.id != first.id
    assert [e.idempotency_key for e in entries()] == [None, "order-42", "order-43"]
    # Finished (here: cancelled), the key is free again.
    admission.cancel(first.id)
    third = ship_order.delay(42)
    assert third.id != first.id
    assert QueueEntry.objects.get(key=third.id).state == EntryState.WAITING


def test_idempotency_key__matches_admitted_and_running_entries(paths: RecordingBridge) -> None:
    make_pool("warehouse", 1)
    first = ship_order.delay(7)
    assert QueueEntry.objects.get(key=first.id).state == EntryState.ADMITTED
    assert ship_order.delay(7).id == first.id
    assert QueueEntry.objects.count() == 1


def test_idempotency_key__a_retry_takes_the_key_over_from_its_attempt(
    paths: RecordingBridge,
) -> None:
    """Task.retry sends the next attempt while the current one runs, with the same key."""
    make_pool("warehouse", 1)
    first = ship_order.delay(9)
    retry = ship_order.apply_async((9,), task_id=first.id, retries=1)
    assert retry.id == first.id
    attempts = entries()
    assert [(e.attempt, e.idempotency_key) for e in attempts] == [(0, None), (1, "order-9")]
    assert ship_order.delay(9).id == first.id  # the retry holds the key now


def test_skip__a_call_while_the_job_waits_or_runs_returns_the_existing_entry(
    paths: RecordingBridge,
) -> None:
    make_pool("warehouse", 1)
    running = skip_job.delay()
    assert skip_job.delay().id == running.id
    block_key = running.id
    admission.cancel(block_key, terminate=True)  # still held until the worker stops it
    assert QueueEntry.objects.filter(task_name=skip_job.name).count() == 1
    entry = QueueEntry.objects.get(key=running.id)
    assert (entry.job, entry.concurrency_policy) == (skip_job.name, "skip")


def test_skip__beat_fire_logs_the_warning_and_queues_nothing(
    paths: RecordingBridge, caplog: pytest.LogCaptureFixture
) -> None:
    make_pool("warehouse", 1)
    block()
    headers = {"periodic_task_name": "skipper"}
    first = skip_job.apply_async(headers=headers)
    with caplog.at_level(logging.WARNING, logger="pools"):
        again = skip_job.apply_async(headers=headers)
    assert again.id == first.id
    assert [r.getMessage() for r in caplog.records if r.name == "pools"] == [
        "Job skipper could not enter pool warehouse: skipped: skipper is already waiting"
    ]
    assert QueueEntry.objects.filter(task_name=skip_job.name).count() == 1


def test_replace__older_waiting_entries_of_the_job_end_superseded_and_are_revoked(
    paths: RecordingBridge,
) -> None:
    make_pool("warehouse", 1)
    block()
    a1 = replace_job.delay("a")
    b1 = replace_job.delay("b")
    a2 = replace_job.delay("a")
    states = {e.key: (e.state, e.reason) for e in entries()}
    assert states[a1.id] == (
        EntryState.SUPERSEDED,
        f"replaced by a newer entry of job {replace_job.name}:a ({a2.id})",
    )
    assert states[b1.id][0] == states[a2.id][0] == EntryState.WAITING
    assert [(f.key, f.state) for f in paths.finished] == [(a1.id, EntryState.SUPERSEDED)]
    assert PoolEvent.objects.filter(kind=EventKind.SUPERSEDED, key=a1.id).exists()


def test_newer_fire_supersedes_the_jobs_queued_retries(paths: RecordingBridge) -> None:
    make_pool("warehouse", 1)
    block()
    fire = add.apply_async((1, 1), headers=BEAT)
    retry = add.apply_async((1, 1), headers=BEAT, task_id=fire.id, retries=1)
    plain_retry = add.apply_async((2, 2), retries=1)  # another job's retry is left alone
    newer = add.apply_async((1, 1), headers=BEAT)
    by_attempt = {(e.key, e.attempt): e for e in entries()}
    assert by_attempt[(retry.id, 1)].state == EntryState.SUPERSEDED
    assert by_attempt[(fire.id, 0)].state == EntryState.WAITING  # a fire, not a retry
    assert by_attempt[(plain_retry.id, 1)].state == EntryState.WAITING
    assert by_attempt[(newer.id, 0)].state == EntryState.WAITING


def test_cancel_of_the_job_supersedes_its_queued_retries(paths: RecordingBridge) -> None:
    make_pool("warehouse", 1)
    block()
    fire = add.apply_async((1, 1), pool_options={"job_key": "k"})
    retry = add.apply_async((1, 1), pool_options={"job_key": "k"}, task_id="r-1", retries=2)
    admission.cancel(fire.id)
    entry = QueueEntry.objects.get(key=retry.id)
    assert entry.state == EntryState.SUPERSEDED
    assert entry.reason == f"job {add.name}:k was cancelled ({fire.id})"


def test_retry_inherits_the_job_of_its_attempt(paths: RecordingBridge) -> None:
    """Task.retry sends no pool_options: the retry keeps its attempt's job and policy."""
    make_pool("warehouse", 1)
    first = add.apply_async((1, 1), pool_options={"job_key": "k", "concurrency_policy": "forbid"})
    add.apply_async((1, 1), task_id=first.id, retries=1)
    assert [(e.job, e.concurrency_policy) for e in entries()] == [(f"{add.name}:k", "forbid")] * 2


def test_idempotency_key__a_lost_race_is_caught_from_the_unique_index(
    paths: RecordingBridge, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The look-up before the insert misses a concurrent winner (simulated): the database's
    unique index refuses the insert, and the submit returns the winner's entry."""
    make_pool("warehouse", 1)
    first = ship_order.delay(42)
    real = enqueueing.holder_of
    calls: list[str] = []

    def missed_once(key: str, **kw: Any) -> Any:
        calls.append(key)
        return None if len(calls) == 1 else real(key, **kw)

    monkeypatch.setattr(enqueueing, "holder_of", missed_once)
    assert ship_order.delay(42).id == first.id
    assert calls == ["order-42", "order-42"]  # before the insert, then after its refusal
    assert QueueEntry.objects.count() == 1


def test_failing_key_callable_on_a_beat_fire__dropped_with_the_warning(
    paths: RecordingBridge, caplog: pytest.LogCaptureFixture
) -> None:
    """Beat must never see an exception: the fire is dropped with the one warning."""
    make_pool("warehouse", 1)
    with caplog.at_level(logging.WARNING, logger="pools"):
        # What beat sends (by name, no argument check): the callable gets no order_id.
        ship_order.app.send_task(ship_order.name, [], {}, headers={"periodic_task_name": "ship"})
    (line,) = [r.getMessage() for r in caplog.records if r.name == "pools"]
    assert line.startswith("Job ship could not enter pool warehouse: The idempotency_key callable")
    assert entries() == []


def test_forbid_through_the_decorator__the_next_instance_waits_for_the_previous(
    paths: RecordingBridge,
) -> None:
    """``@pooled(concurrency_policy="forbid")`` end to end: the gate gives the entry its job
    (the task name) and policy; the second call waits although a slot is free, and blocks
    the line behind it, until the first settles."""
    from pools.core import explain

    make_pool("warehouse", 3)
    first = forbid_job.delay(1)
    second = forbid_job.delay(2)
    other = add.delay(1, 1)
    assert paths.keys() == [first.id]
    assert [(e.job, e.concurrency_policy) for e in entries()][:2] == [
        (forbid_job.name, "forbid")
    ] * 2
    assert explain.explain_key(second.id).blocked_by == "forbid"
    assert explain.explain_key(other.id).blocked_by == "head_of_line"
    adm = paths.admissions[0]
    assert admission.settle(adm.entry_id, adm.token, "succeeded")
    assert paths.keys() == [first.id, second.id, other.id]
