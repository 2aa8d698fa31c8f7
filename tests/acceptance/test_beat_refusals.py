"""A real celery beat (DatabaseScheduler) firing a pooled job into a full pool.

Every refused fire is dropped with exactly one WARNING, ``Job <name> could not enter pool
<pool>: <reason>`` (the ``pools`` logger, in beat's own log), beat logs no "Message Error"
and goes on with its other jobs (the sweep keeps being sent), and nothing is queued.
"""

from __future__ import annotations

import re

from django_celery_beat.models import IntervalSchedule, PeriodicTask

from pools.models import QueueEntry
from tests.acceptance import faults_support
from tests.acceptance.conftest import WORKER_TEST_MARKS
from tests.acceptance.faults_support import wait_for
from tests.support.factories import make_pool, submit
from tests.testapp.tasks import add

pytestmark = WORKER_TEST_MARKS

short_leases = faults_support.short_leases
celery_beat = faults_support.celery_beat

WARNING = re.compile(
    r"WARNING/MainProcess\] Job refused job could not enter pool warehouse: "
    r"Pool 'warehouse' is full: it already has 1 waiting entries \(max_queued=1\)\. "
    r"Retry later, or raise max_queued for this pool\.\n"
)


def test_beat__refused_fires_are_dropped_with_one_warning_each_and_beat_goes_on(
    short_leases, celery_workers, celery_beat
):
    celery_workers(count=1, concurrency=1)  # first: a worker start syncs POOLS definitions
    # Paused with one waiting entry and max_queued=1: full for the whole test.
    make_pool("warehouse", 1, max_queued=1, paused=True)
    submit("warehouse", key="waiting")
    every, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(name="refused job", task=add.name, interval=every, args="[1, 2]")
    beat = celery_beat()

    def fires() -> int:
        return int(beat.log_text().count("Sending due task refused job"))

    wait_for(lambda: fires() >= 3, 30, "three fires of the refused job")
    sweeps = beat.sweeps_sent()
    wait_for(lambda: beat.sweeps_sent() >= sweeps + 2, 15, "two more sweeps after the refusals")
    text = beat.log_text()
    sent = text.count("Sending due task refused job")
    warned = len(WARNING.findall(text))
    # One warning per fire (the newest fire's line may still be on its way to the log).
    assert sent - 1 <= warned <= sent, text[-3000:]
    assert text.count("could not enter pool") == warned  # no other refusal line
    assert "Message Error" not in text and "ERROR/" not in text, text[-3000:]
    assert list(QueueEntry.objects.values_list("key", flat=True)) == ["waiting"]
