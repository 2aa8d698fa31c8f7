"""Rate limits with real workers: 2 prefork workers x 4 processes on Redis.

Windows are counted with :func:`pools.bench.rates.max_in_window`, the checker the
``rates`` benchmark uses too, on two independent records, both exact (no tolerance):

* **The admissions.** A PostgreSQL trigger (:func:`admission_log`) copies every rate mark
  the admission writes — one per admission and rate, stamped with the database clock —
  into a table the core never reads. No window may hold more than the limit.
* **The bodies' own start times** (``time.time()`` on a body's first line), which are
  what a partner API sees. A rated entry's start confirms its place in the pool's window
  of starts (:mod:`pools.core.starts`), so no window of ``W`` of these times may hold more
  than ``N`` either: whatever the publish, the broker, prefetch and the prefork hand-off
  did to the delay between admission and start.

Cases: the first second after a burst of calls (the bodies of the first window start
late while the caller still submits), a second worker started late, prefetch multiplier
1 and 4. Controls show the checks can fail: unpooled, the same workers start far more
than 20 bodies in a second; the sabotage twin of the start check is in
``tests/integration/core/test_rate_starts.py``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import pytest

from pools.bench.rates import AdmissionLog as Log
from pools.bench.rates import achieved_rate, max_in_window
from pools.core import capacity, pool_crud, rates
from tests.acceptance.conftest import WORKER_TEST_MARKS, StartWorkers, wait_for
from tests.acceptance.faults_support import max_overlap
from tests.testapp import rate_tasks

pytestmark = [*WORKER_TEST_MARKS, pytest.mark.timeout(180)]

rated: Any = rate_tasks.rated
two_rated: Any = rate_tasks.two_rated
slots_rated: Any = rate_tasks.slots_rated
unrated: Any = rate_tasks.unrated
own_rate: Any = rate_tasks.own_rate

#: The achieved rate while backlogged must reach this share of the limit. A start waits
#: for ``W`` plus the hand-off margin after the ``N``-th previous one, so a window of
#: ``W = 1 s`` gives at most ``N / 1.1`` per second (91 %); and a window's starts begin
#: only as its admissions reach the workers, so the next window opens that much later
#: (16.6/s of 20/s was seen on the shared 2-core machine: docs/benchmarks.md).
MIN_SHARE = 0.7
RESULT_TIMEOUT = 60


def _rate_pool(name: str, **fields: Any) -> None:
    """Create pool ``name`` with ``fields`` (its rate), paused: the backlog is queued first.

    Without ``slots`` the pool limits starts only (as ``{"rate": "20/s"}`` in settings).
    """
    fields.setdefault("slots", rates.UNLIMITED_SLOTS)
    pool_crud.create_pool(name=name, paused=True, **fields)


def _release(name: str) -> None:
    capacity.set_paused(name, False)


def _starts(results: list[Any]) -> list[dict[str, Any]]:
    return [r.get(timeout=RESULT_TIMEOUT) for r in results]


class AdmissionLog(Protocol):
    """Every admission of pool ``pool`` for its rate ``rate_index``, in admission order, as
    POSIX seconds of the database's clock (item ``k``: the pool's admission number ``k``)."""

    def __call__(self, pool: str, rate_index: int = 0) -> list[float]: ...


@pytest.fixture
def admission_log(transactional_db: None) -> Iterator[AdmissionLog]:
    """Every admission of a (fresh) rated pool, logged by :class:`pools.bench.rates.
    AdmissionLog`: a trigger copies each rate mark as the admission writes it."""
    if not Log.available():
        pytest.skip("the admission log is a PostgreSQL trigger")

    with Log() as log:

        def read(pool: str, rate_index: int = 0) -> list[float]:
            first, times = log.read(pool, rate_index)
            assert first == 0, "a fresh pool's first admission writes slot 0"
            return times

        yield read


@dataclass(frozen=True)
class Checked:
    """What :func:`_check_window` saw."""

    #: Most bodies started in one window.
    most: int
    #: Starts per second over the whole windows from the first start.
    rate: float


def _check_window(
    spans: list[dict[str, Any]], count: int, seconds: float, admissions: list[float]
) -> Checked:
    """Assert the rate ``count / seconds`` exactly, on the admissions (database clock) and
    on the bodies' own start times: no window of ``seconds`` holds more than ``count``."""
    exact, when = max_in_window(admissions, seconds)
    assert exact <= count, (
        f"the database admitted {exact} entries within {seconds:g} s "
        f"from {when - min(admissions):.6f} s (limit {count})"
    )
    starts = [s["start"] for s in spans]
    most, at = max_in_window(starts, seconds)
    assert most <= count, (
        f"{most} bodies started within {seconds:g} s from {at - min(starts):.3f} s (limit {count})"
    )
    seen = Checked(most=most, rate=achieved_rate(starts, seconds))
    print(f"{count}/{seconds:g}s: {seen}")  # shown with -s: the figures docs/benchmarks.md quotes
    return seen


def test_rate_only_pool__300_tasks_never_more_than_20_starts_in_any_second(
    celery_workers: StartWorkers, admission_log: AdmissionLog
) -> None:
    celery_workers(count=2, concurrency=4)
    # Control: unpooled, the same workers start far more than 20 no-op bodies in a second,
    # so the check below can fail.
    control = _starts([unrated.delay(i) for i in range(100)])
    assert max_in_window([s["start"] for s in control], 1.0)[0] > 40

    _rate_pool(rate_tasks.RATE_POOL, rate="20/s")
    results = [rated.delay(i) for i in range(300)]
    _release(rate_tasks.RATE_POOL)
    spans = _starts(results)
    assert sorted(s["i"] for s in spans) == list(range(300))
    seen = _check_window(spans, 20, 1.0, admission_log(rate_tasks.RATE_POOL))
    # Backlogged from the release to the last start: 300 tasks are ~15 windows of 20.
    assert seen.rate >= MIN_SHARE * 20, f"achieved {seen}"


def test_two_rates__5_per_second_until_30_in_the_minute_then_held_with_a_wake_up(
    celery_workers: StartWorkers, admission_log: AdmissionLog
) -> None:
    """``["5/s", "30/m"]`` with 40 tasks: 30 start at 5/s (~6 s), then the minute's window
    holds the other 10 until a minute after the first admission.

    The count is chosen to exercise both windows while keeping the test short: waiting for
    the minute's window to open (and the last 10 to run) would add a minute to this file, so
    the test checks the 30/m window from the other side: after the 30th start nothing starts
    for the rest of the observation, ``explain`` says ``rate_limited`` until the window
    opens, and the 10 waiting entries are cancelled (cancelled entries never count).
    """
    from pools import cancel
    from pools.core import explain
    from pools.models import Pool, QueueEntry
    from pools.states import EntryState

    celery_workers(count=2, concurrency=4)
    _rate_pool(rate_tasks.TWO_RATES_POOL, rate=["5/s", "30/m"])
    results = [two_rated.delay(i) for i in range(40)]
    _release(rate_tasks.TWO_RATES_POOL)
    keys = [r.id for r in results]

    def succeeded() -> int:
        return QueueEntry.objects.filter(key__in=keys, state=EntryState.SUCCEEDED).count()

    wait_for(lambda: succeeded() >= 30, 30, "30 bodies at 5/s")
    # Three more seconds: at 5/s, 15 more would have started without the 30/m rate.
    time.sleep(3)
    assert succeeded() == 30
    done = [r for r in results if r.ready()]
    assert len(done) == 30
    spans = _starts(done)
    pool = rate_tasks.TWO_RATES_POOL
    per_second, per_minute = admission_log(pool, 0), admission_log(pool, 1)
    assert len(per_second) == len(per_minute) == 30
    seen = _check_window(spans, 5, 1.0, per_second)
    assert seen.rate >= MIN_SHARE * 5, f"achieved {seen}"
    assert _check_window(spans, 30, 60.0, per_minute).most == 30

    waiting = QueueEntry.objects.filter(key__in=keys, state=EntryState.WAITING)
    assert waiting.count() == 10
    why = explain.explain(waiting.order_by("pk").first())  # type: ignore[arg-type]
    assert why.blocked_by == "rate_limited"
    place = next(p for p in why.places if p.blocked_by == "rate_limited")
    # The minute's window opens a minute after the first admission (database clock).
    first_admitted = per_minute[0]
    until = place.detail["until"]
    opens = until.timestamp() if hasattr(until, "timestamp") else _iso(until)
    assert math.isclose(opens, first_admitted + 60.0, abs_tol=1.0), (opens, first_admitted)
    for entry in waiting:
        cancel(entry.key)
    assert not QueueEntry.objects.filter(key__in=keys, state=EntryState.WAITING).exists()
    # The cancelled entries were never admitted: the pool counted 30 admissions.
    assert Pool.objects.get(name=pool).admissions == 30


def _iso(value: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(value).timestamp()


def test_slots_and_rate__never_more_than_2_running_nor_20_starts_in_a_second(
    celery_workers: StartWorkers, admission_log: AdmissionLog
) -> None:
    """``{"slots": 2, "rate": "20/s"}``, 50 ms bodies: two slots alone would allow ~40/s
    (~25-30/s with the hand-off), so the rate binds; a window of 20 admitted at once
    would run 8 at a time on these workers, so the slots bind too."""
    celery_workers(count=2, concurrency=4)
    _rate_pool(rate_tasks.SLOTS_RATE_POOL, slots=2, rate="20/s")
    results = [slots_rated.delay(i, 0.05) for i in range(100)]
    _release(rate_tasks.SLOTS_RATE_POOL)
    spans = _starts(results)
    assert sorted(s["i"] for s in spans) == list(range(100))
    peak = max_overlap([(s["start"], s["end"]) for s in spans])
    assert peak <= 2, f"{peak} bodies of a 2-slot pool ran at once"
    seen = _check_window(spans, 20, 1.0, admission_log(rate_tasks.SLOTS_RATE_POOL))
    assert seen.rate >= MIN_SHARE * 20, f"achieved {seen}"


def test_task_rate__pooled_rate_20_per_second_across_both_workers(
    celery_workers: StartWorkers, admission_log: AdmissionLog
) -> None:
    """``@pooled(rate="20/s")`` and no named pool: the task's own rated pool, global where
    Celery's ``rate_limit="20/s"`` would allow 20/s per worker (40/s on these two)."""
    from pools.pool_names import TASK_CAP_PREFIX, cap_pool_name

    celery_workers(count=2, concurrency=4)
    # The task's pool is made at the first submit: the line fills faster than 20/s.
    spans = _starts([own_rate.delay(i) for i in range(100)])
    assert sorted(s["i"] for s in spans) == list(range(100))
    pool = cap_pool_name(TASK_CAP_PREFIX, own_rate.name)
    seen = _check_window(spans, 20, 1.0, admission_log(pool))
    # Exactness is the point here; the 90 % throughput bar is the named-pool tests' (this
    # one reached 18.0/s once under load, and its first submit also creates the pool).
    assert seen.rate >= 0.5 * 20, f"achieved {seen}"


def test_admission_log__sees_an_overfilled_window_when_the_rates_change(
    admission_log: AdmissionLog,
) -> None:
    """The sabotage twin of the exact check: a pool's new rates start from empty windows
    (documented), so a rate changed right after a window filled lets more than the old
    limit through within one second — and the log and the checker see it. (No workers:
    admission needs none; the messages stay in the broker, flushed by the next test.)"""
    _rate_pool(rate_tasks.RATE_POOL, rate="20/s")
    for i in range(60):
        rated.delay(i)
    _release(rate_tasks.RATE_POOL)  # 20 admitted now
    pool_crud.update_pool(rate_tasks.RATE_POOL, rate="21/s")  # 21 more at once
    admitted = admission_log(rate_tasks.RATE_POOL)
    assert len(admitted) == 41
    assert max_in_window(admitted, 1.0)[0] == 41


@pytest.mark.parametrize("prefetch", [1, 4])
def test_rate_only_pool__calls_sent_in_a_loop_never_more_than_20_starts_in_any_second(
    celery_workers: StartWorkers, admission_log: AdmissionLog, prefetch: int
) -> None:
    """The pool is open while the caller submits: the first window's bodies start late (the
    caller still submits, the workers prefetch), the next window is admitted a second after
    the first admissions. Their bodies' starts still keep 20 in any second."""
    celery_workers(count=2, concurrency=4, extra_args=[f"--prefetch-multiplier={prefetch}"])
    _rate_pool(rate_tasks.RATE_POOL, rate="20/s")
    _release(rate_tasks.RATE_POOL)
    spans = _starts([rated.delay(i) for i in range(120)])
    assert sorted(s["i"] for s in spans) == list(range(120))
    seen = _check_window(spans, 20, 1.0, admission_log(rate_tasks.RATE_POOL))
    assert seen.rate >= 0.5 * 20, f"achieved {seen}"


def test_rate_only_pool__a_worker_started_late_never_more_than_20_starts_in_any_second(
    celery_workers: StartWorkers, admission_log: AdmissionLog
) -> None:
    """One worker (4 processes, prefetch 4) takes the first windows; a second one joins a
    second later with the backlog's messages to pick up: its first starts come late
    after their admissions, bunched with the next window's."""
    celery_workers(count=1, concurrency=4, extra_args=["--prefetch-multiplier=4"])
    _rate_pool(rate_tasks.RATE_POOL, rate="20/s")
    _release(rate_tasks.RATE_POOL)
    results = [rated.delay(i) for i in range(100)]
    time.sleep(1.0)
    celery_workers(count=1, concurrency=4, extra_args=["--prefetch-multiplier=4"])
    spans = _starts(results)
    assert sorted(s["i"] for s in spans) == list(range(100))
    _check_window(spans, 20, 1.0, admission_log(rate_tasks.RATE_POOL))
