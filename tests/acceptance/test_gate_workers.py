"""The gate across real workers: two prefork workers (8 processes) share a 3-slot pool."""

from __future__ import annotations

import random
import time
from collections import Counter

from celery.result import AsyncResult

from pools import snapshot
from pools.core import capacity
from pools.models import Pool, PoolEvent, QueueEntry
from pools.states import EntryState, EventKind
from tests.acceptance.conftest import WORKER_TEST_MARKS, StartWorkers
from tests.acceptance.faults_support import max_overlap
from tests.testapp.tasks import ACCEPT_POOL, free_span, span

pytestmark = WORKER_TEST_MARKS

SLOTS = 3
TASKS = 200
RESULT_TIMEOUT = 120


def test_max_overlap__counts_intervals_covering_one_instant() -> None:
    assert max_overlap([]) == 0
    assert max_overlap([(0, 1), (1, 2), (2, 3)]) == 1
    assert max_overlap([(0, 3), (1, 4), (2, 5), (2.5, 2.6)]) == 4
    assert max_overlap([(0, 1), (0.5, 2), (1.5, 3)]) == 2


def set_paused(name: str, paused: bool) -> None:
    """Pause or resume a pool the way the admin and the API do (the service runs admission)."""
    pool = Pool.objects.get(name=name)
    was = pool.paused
    pool.paused = paused
    pool.save(update_fields=["paused", "updated_at"])
    capacity.pool_saved(pool, old_slots=pool.slots, old_paused=was)


def held_now(name: str) -> int:
    return snapshot(name).held


def test_workers__three_slot_pool_admits_by_priority_and_never_overlaps(
    celery_workers: StartWorkers,
) -> None:
    workers = celery_workers(count=2, concurrency=4)
    names = {w.name for w in workers}

    # Control: the same body, unpooled, does overlap on these workers. It shows the
    # workers really offer more than 3 processes and that max_overlap would notice.
    control = [free_span.delay(i, 0.3) for i in range(16)]
    control_spans = [r.get(timeout=RESULT_TIMEOUT) for r in control]
    assert max_overlap([(s["start"], s["end"]) for s in control_spans]) > SLOTS

    Pool.objects.create(name=ACCEPT_POOL, slots=SLOTS, paused=True)
    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    results: list[AsyncResult] = []
    priorities: dict[str, int] = {}
    for i in range(TASKS):
        priority = rnd.randint(0, 9)
        result = span.apply_async((i,), {"sleep": 0.03}, pool_options={"priority": priority})  # type: ignore[call-arg]  # celery-types: no **options
        results.append(result)
        priorities[result.id] = priority

    # Paused: everything waits, nothing is admitted or published.
    snap = snapshot(ACCEPT_POOL)
    assert (snap.held, snap.waiting) == (0, TASKS)
    assert not QueueEntry.objects.filter(task_name=span.name, admitted_at__isnull=False).exists()
    entries = {e.key: e for e in QueueEntry.objects.filter(task_name=span.name)}
    assert {k: e.priority for k, e in entries.items()} == priorities, f"seed={seed}"

    set_paused(ACCEPT_POOL, False)

    # (b) every result arrives; sample held slots while waiting.
    held_samples = []
    spans = []
    for result in results:
        held_samples.append(held_now(ACCEPT_POOL))
        spans.append(result.get(timeout=RESULT_TIMEOUT))
    assert max(held_samples) <= SLOTS

    # (a) at most SLOTS bodies ever ran at the same time, on any worker.
    peak = max_overlap([(s["start"], s["end"]) for s in spans])
    assert peak <= SLOTS, f"{peak} bodies overlapped in a {SLOTS}-slot pool"
    assert peak >= 2, "bodies never overlapped at all: the workers did not run in parallel"

    # Both workers (and several processes) ran pooled bodies, each under its own claim.
    assert {s["hostname"] for s in spans} == names
    assert len({(s["hostname"], s["pid"]) for s in spans}) > 2
    assert [s["key"] for s in spans] == [r.id for r in results]
    assert all(s["entry_id"] == entries[s["key"]].queue_id and s["token"] for s in spans)

    # (c) every entry settles as succeeded (settle follows the stored result closely).
    def all_settled() -> bool:
        return (
            not QueueEntry.objects.filter(task_name=span.name)
            .exclude(state__in=[EntryState.SUCCEEDED, EntryState.FAILED])
            .exists()
        )

    deadline = time.monotonic() + 30
    while not all_settled() and time.monotonic() < deadline:
        time.sleep(0.1)
    states = Counter(QueueEntry.objects.filter(task_name=span.name).values_list("state", flat=True))
    assert states == {EntryState.SUCCEEDED: TASKS}
    assert snapshot(ACCEPT_POOL).held == 0

    # (d) admission order follows (-priority, enqueued_at, queue_id): the pool counts its
    # admissions under its lock and each entry keeps its place (admission_seq).
    admitted = list(
        QueueEntry.objects.filter(task_name=span.name, admission_seq__isnull=False)
        .order_by("admission_seq")
        .values_list("queue_id", flat=True)
    )
    expected = list(
        QueueEntry.objects.filter(task_name=span.name)
        .in_line_order()
        .values_list("queue_id", flat=True)
    )
    assert len(admitted) == TASKS
    tokens = set(QueueEntry.objects.filter(task_name=span.name).values_list("token", flat=True))
    assert tokens == {1}, "each entry is admitted exactly once"
    assert admitted == expected, f"admission order differs from priority order (seed={seed})"
    started = QueueEntry.objects.filter(task_name=span.name, started_at__isnull=False)
    assert started.count() == TASKS  # once each: token 1, and no skipped delivery below
    assert not PoolEvent.objects.filter(
        pool=ACCEPT_POOL, kind__in=[EventKind.SKIPPED, EventKind.REQUEUED]
    ).exists()


def test_workers__fast_path_under_load_never_overlaps(celery_workers: StartWorkers) -> None:
    """No pause: submissions race the workers' settles; the pool still never overflows."""
    workers = celery_workers(count=2, concurrency=4)
    Pool.objects.create(name=ACCEPT_POOL, slots=SLOTS)
    results = [span.delay(i, 0.02) for i in range(60)]
    spans = [r.get(timeout=RESULT_TIMEOUT) for r in results]
    peak = max_overlap([(s["start"], s["end"]) for s in spans])
    assert peak <= SLOTS, f"{peak} bodies overlapped in a {SLOTS}-slot pool"
    assert {s["hostname"] for s in spans} <= {w.name for w in workers}
    entries = QueueEntry.objects.filter(task_name=span.name)
    assert entries.filter(admitted_at__isnull=False, token=1).count() == len(results)
