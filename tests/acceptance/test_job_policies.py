"""Job policies with real workers and a real celery beat (DatabaseScheduler).

* ``skip``: a pooled job firing every second while its previous fire runs, then while it
  waits, is not queued again: each fire logs ``Job <name> could not enter pool <pool>:
  skipped: <name> is already running|waiting`` once, and beat keeps its other schedule.
* A success of the job supersedes its queued retries (the worker, after settling).
"""

from __future__ import annotations

import re

import pytest
from celery.exceptions import TaskRevokedError
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from pools.models import Pool, QueueEntry
from pools.states import EntryState
from tests.acceptance import faults_support
from tests.acceptance.conftest import WORKER_TEST_MARKS
from tests.acceptance.faults_support import wait_for
from tests.support.factories import make_pool
from tests.testapp.tasks import flaky_order, retrying_job, skip_job

pytestmark = WORKER_TEST_MARKS

short_leases = faults_support.short_leases
celery_beat = faults_support.celery_beat

TIMEOUT = 30


def skipped(state: str) -> re.Pattern[str]:
    return re.compile(
        r"WARNING/MainProcess\] Job skipper could not enter pool warehouse: "
        rf"skipped: skipper is already {state}\n"
    )


def test_beat__skip_job_is_not_queued_while_it_runs_or_waits(
    short_leases, celery_workers, celery_beat
):
    celery_workers(count=1, concurrency=1)
    make_pool("warehouse", 1)
    every, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.SECONDS)
    # Each run takes 6 s; beat fires every second.
    PeriodicTask.objects.create(name="skipper", task=skip_job.name, interval=every, args="[6]")
    beat = celery_beat()

    def running() -> list[QueueEntry]:
        return list(QueueEntry.objects.filter(job="skipper", state=EntryState.RUNNING))

    wait_for(lambda: len(skipped("running").findall(beat.log_text())) >= 2, TIMEOUT, "skips")
    # Paused: the next fire waits, and the fires after it are skipped as waiting.
    Pool.objects.filter(name="warehouse").update(paused=True)
    wait_for(
        lambda: len(skipped("waiting").findall(beat.log_text())) >= 2, TIMEOUT, "waiting skips"
    )
    sweeps = beat.sweeps_sent()
    wait_for(lambda: beat.sweeps_sent() >= sweeps + 2, 15, "beat keeps its other schedule")
    text = beat.log_text()
    assert "Message Error" not in text and "ERROR/" not in text, text[-3000:]
    unfinished = QueueEntry.objects.filter(
        job="skipper", state__in=[EntryState.WAITING, EntryState.ADMITTED, EntryState.RUNNING]
    )
    assert unfinished.count() <= 2  # at most the one running and the one waiting
    assert unfinished.filter(state=EntryState.WAITING).count() <= 1
    fires = text.count("Sending due task skipper")
    warned = len(skipped("running").findall(text)) + len(skipped("waiting").findall(text))
    entries = QueueEntry.objects.filter(job="skipper").count()
    # Every fire either made an entry or logged one skip (the newest line may be on its way).
    assert fires - 1 <= entries + warned <= fires, text[-3000:]
    assert running() or unfinished.exists()


def test_success_of_the_job_supersedes_its_queued_retries(short_leases, celery_workers):
    celery_workers(count=1, concurrency=1)
    make_pool("warehouse", 1)
    first = retrying_job.delay("retry")
    wait_for(
        lambda: QueueEntry.objects.filter(key=first.id, attempt=1, state="waiting").exists(),
        TIMEOUT,
        "the retry queued a minute ahead",
    )
    assert retrying_job.delay("ok").get(timeout=TIMEOUT) == "ok"
    wait_for(
        lambda: QueueEntry.objects.filter(
            key=first.id, attempt=1, state=EntryState.SUPERSEDED
        ).exists(),
        TIMEOUT,
        "the queued retry superseded",
    )
    entry = QueueEntry.objects.get(key=first.id, attempt=1)
    assert entry.reason.startswith(f"job {retrying_job.name}:retrying succeeded (")
    with pytest.raises(TaskRevokedError):
        first.get(timeout=TIMEOUT)


def test_idempotent_task_that_retries__the_retry_keeps_the_key(short_leases, celery_workers):
    """Task.retry sends the next attempt while the first still runs, with the same key: the
    key moves to the retry, which runs; a submit meanwhile gets the same task id."""
    celery_workers(count=1, concurrency=1)
    make_pool("warehouse", 1)
    first = flaky_order.delay(5)
    wait_for(
        lambda: QueueEntry.objects.filter(key=first.id, attempt=1).exists(),
        TIMEOUT,
        "the retry queued",
    )
    assert flaky_order.delay(5).id == first.id
    assert first.get(timeout=TIMEOUT) == 5
    # The result is stored before the worker settles the claim (task_postrun).
    wait_for(
        lambda: QueueEntry.objects.filter(key=first.id, state=EntryState.SUCCEEDED).exists(),
        TIMEOUT,
        "the retry settled",
    )
    assert list(
        QueueEntry.objects.filter(key=first.id).order_by("attempt").values_list("state", "attempt")
    ) == [(EntryState.RETRIED, 0), (EntryState.SUCCEEDED, 1)]
