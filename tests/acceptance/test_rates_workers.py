"""Rate limits with real workers (issue 17): 2 prefork workers x 4 processes on Redis.

Every check counts the bodies' own start times (``time.time()`` on a body's first line) with
:func:`pools.bench.rates.max_in_window`, the checker the ``rates`` benchmark uses too.

**Tolerance.** The pool admits under its lock at the database's clock; a body starts a
little later, after the publish, the broker and the prefork hand-off, and that delay varies
from one task to the next (a few ms, tens of ms on a busy 2-core machine). Two admissions
exactly one window apart can therefore start a little less than one window apart, and a
window of *start* times can hold a start or two more than any window of *admissions*. The
start-time checks allow :data:`TOLERANCE` starts over the limit; the admission times the
database recorded are checked with no tolerance at all.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from pools.bench.rates import achieved_rate, max_in_window
from pools.core import definitions
from tests.acceptance.conftest import WORKER_TEST_MARKS, StartWorkers, wait_for
from tests.acceptance.faults_support import max_overlap
from tests.testapp import rate_tasks

pytestmark = [*WORKER_TEST_MARKS, pytest.mark.timeout(180)]

rated: Any = rate_tasks.rated
two_rated: Any = rate_tasks.two_rated
slots_rated: Any = rate_tasks.slots_rated
unrated: Any = rate_tasks.unrated

#: Starts over the limit that one window of the bodies' start times may hold (see above).
TOLERANCE = 2
#: The achieved rate while backlogged must reach this share of the limit.
MIN_SHARE = 0.9
RESULT_TIMEOUT = 60


def _rate_pool(name: str, **fields: Any) -> None:
    """Create pool ``name`` with ``fields`` (its rate), paused: the backlog is queued first."""
    definitions.create_pool(name=name, paused=True, **fields)


def _release(name: str) -> None:
    definitions.set_paused(name, False)


def _starts(results: list[Any]) -> list[dict[str, Any]]:
    return [r.get(timeout=RESULT_TIMEOUT) for r in results]


def _admitted_at(entry_ids: list[int]) -> list[float]:
    """When the database admitted each entry (its own clock), as POSIX seconds."""
    from pools.models import QueueEntry

    rows = QueueEntry.objects.filter(pk__in=entry_ids).values_list("admitted_at", flat=True)
    return [t.timestamp() for t in rows if t is not None]


def _check_window(spans: list[dict[str, Any]], count: int, seconds: float) -> tuple[int, float]:
    """Assert the limit on the start times and on the admission times; return (most, rate)."""
    starts = [s["start"] for s in spans]
    most, at = max_in_window(starts, seconds)
    assert most <= count + TOLERANCE, (
        f"{most} bodies started within {seconds:g} s from {at - min(starts):.3f} s "
        f"(limit {count}, tolerance {TOLERANCE})"
    )
    admitted = _admitted_at([s["entry_id"] for s in spans])
    assert len(admitted) == len(spans)
    exact, _ = max_in_window(admitted, seconds)
    assert exact <= count, f"the database admitted {exact} entries within {seconds:g} s"
    return most, achieved_rate(starts, seconds)


def test_rate_only_pool__300_tasks_never_more_than_20_starts_in_any_second(
    celery_workers: StartWorkers,
) -> None:
    celery_workers(count=2, concurrency=4)
    # Control: unpooled, the same workers start far more than 20 no-op bodies in a second,
    # so the check below can fail.
    control = _starts([unrated.delay(i) for i in range(100)])
    assert max_in_window([s["start"] for s in control], 1.0)[0] > 20 + TOLERANCE

    _rate_pool(rate_tasks.RATE_POOL, rate="20/s")
    results = [rated.delay(i) for i in range(300)]
    _release(rate_tasks.RATE_POOL)
    spans = _starts(results)
    assert sorted(s["i"] for s in spans) == list(range(300))
    most, rate = _check_window(spans, 20, 1.0)
    # Backlogged from the release to the last start: 300 tasks are ~15 windows of 20.
    assert rate >= MIN_SHARE * 20, f"achieved {rate:.1f} starts/s of 20/s (most {most} in 1 s)"


def test_two_rates__5_per_second_until_30_in_the_minute_then_held_with_a_wake_up(
    celery_workers: StartWorkers,
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
    from pools.models import EntryState, QueueEntry

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
    most, rate = _check_window(spans, 5, 1.0)
    assert rate >= MIN_SHARE * 5, f"achieved {rate:.1f} starts/s of 5/s (most {most} in 1 s)"
    assert _check_window(spans, 30, 60.0)[0] == 30

    waiting = QueueEntry.objects.filter(key__in=keys, state=EntryState.WAITING)
    assert waiting.count() == 10
    why = explain.explain(waiting.order_by("pk").first())  # type: ignore[arg-type]
    assert why.blocked_by == "rate_limited"
    place = next(p for p in why.places if p.blocked_by == "rate_limited")
    first_admitted = min(_admitted_at([s["entry_id"] for s in spans]))
    until = place.detail["until"]
    opens = until.timestamp() if hasattr(until, "timestamp") else _iso(until)
    assert math.isclose(opens, first_admitted + 60.0, abs_tol=1.0), (opens, first_admitted)
    for entry in waiting:
        cancel(entry.key)
    assert not QueueEntry.objects.filter(key__in=keys, state=EntryState.WAITING).exists()


def _iso(value: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(value).timestamp()


def test_slots_and_rate__never_more_than_2_running_nor_20_starts_in_a_second(
    celery_workers: StartWorkers,
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
    most, rate = _check_window(spans, 20, 1.0)
    assert rate >= MIN_SHARE * 20, f"achieved {rate:.1f} starts/s of 20/s (most {most} in 1 s)"
