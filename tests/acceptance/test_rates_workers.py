"""Rate limits with real workers (issue 17): 2 prefork workers x 4 processes on Redis.

Every check counts the bodies' own start times (``time.time()`` on a body's first line) with
:func:`pools.bench.rates.max_in_window`, the checker the ``rates`` benchmark uses too.

**Tolerance.** The pool admits under its lock at the database's clock; a body starts a
little later, after the publish, the broker and the prefork hand-off, and that delay varies
from one task to the next (a few ms, tens of ms on a busy 2-core machine). Two admissions
exactly one window apart can therefore start a little less than one window apart, and a
window of *start* times can hold a start or two more than any window of *admissions*. The
start-time checks allow :data:`TOLERANCE` starts over the limit.

The admissions themselves are checked with no tolerance, at the database's clock, by an
independent recorder: a trigger (PostgreSQL) copies every rate mark the admission writes
(``RateMark``: one per admission and rate, stamped with the database clock) into a log
table the core never reads, so the log keeps every admission although the core's ring
keeps only the last ``N``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connection

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


#: Reads the database-clock times of every admission logged for (pool name, rate index).
MarkLog = Callable[[str, int], list[float]]


@pytest.fixture
def mark_log(transactional_db: None) -> Iterator[MarkLog | None]:
    """An independent log of the rate marks written (PostgreSQL; None elsewhere)."""
    from pools.models import Pool, RateMark

    if connection.vendor != "postgresql":
        yield None
        return
    marks = connection.ops.quote_name(RateMark._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TABLE rates_test_marks (pool_id bigint, rate_index int, at timestamptz)"
        )
        cursor.execute(
            "CREATE FUNCTION rates_test_log() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "INSERT INTO rates_test_marks VALUES (NEW.pool_id, NEW.rate_index, NEW.at); "
            "RETURN NEW; END $$"
        )
        cursor.execute(
            f"CREATE TRIGGER rates_test_log AFTER INSERT OR UPDATE ON {marks} "
            "FOR EACH ROW EXECUTE FUNCTION rates_test_log()"
        )

    def read(pool: str, rate_index: int) -> list[float]:
        pk = Pool.objects.get(name=pool).pk
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT extract(epoch FROM at) FROM rates_test_marks "
                "WHERE pool_id = %s AND rate_index = %s",
                [pk, rate_index],
            )
            return [float(row[0]) for row in cursor.fetchall()]

    try:
        yield read
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"DROP TRIGGER IF EXISTS rates_test_log ON {marks}")
            cursor.execute("DROP FUNCTION IF EXISTS rates_test_log()")
            cursor.execute("DROP TABLE IF EXISTS rates_test_marks")


def _check_window(
    spans: list[dict[str, Any]],
    count: int,
    seconds: float,
    admissions: list[float] | None,
) -> tuple[int, float]:
    """Assert the limit on the bodies' start times (with :data:`TOLERANCE`) and on the
    database's admission times (exactly); return (most starts in a window, achieved rate)."""
    starts = [s["start"] for s in spans]
    most, at = max_in_window(starts, seconds)
    assert most <= count + TOLERANCE, (
        f"{most} bodies started within {seconds:g} s from {at - min(starts):.3f} s "
        f"(limit {count}, tolerance {TOLERANCE})"
    )
    if admissions is not None:
        assert len(admissions) >= len(spans)
        exact, when = max_in_window(admissions, seconds)
        assert exact <= count, (
            f"the database admitted {exact} entries within {seconds:g} s "
            f"from {when - min(admissions):.6f} s"
        )
    return most, achieved_rate(starts, seconds)


def test_rate_only_pool__300_tasks_never_more_than_20_starts_in_any_second(
    celery_workers: StartWorkers, mark_log: MarkLog | None
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
    admissions = mark_log(rate_tasks.RATE_POOL, 0) if mark_log else None
    most, rate = _check_window(spans, 20, 1.0, admissions)
    # Backlogged from the release to the last start: 300 tasks are ~15 windows of 20.
    assert rate >= MIN_SHARE * 20, f"achieved {rate:.1f} starts/s of 20/s (most {most} in 1 s)"


def test_two_rates__5_per_second_until_30_in_the_minute_then_held_with_a_wake_up(
    celery_workers: StartWorkers, mark_log: MarkLog | None
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
    from pools.models import EntryState, Pool, QueueEntry

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
    per_second = mark_log(pool, 0) if mark_log else None
    per_minute = mark_log(pool, 1) if mark_log else None
    most, rate = _check_window(spans, 5, 1.0, per_second)
    assert rate >= MIN_SHARE * 5, f"achieved {rate:.1f} starts/s of 5/s (most {most} in 1 s)"
    assert _check_window(spans, 30, 60.0, per_minute)[0] == 30

    waiting = QueueEntry.objects.filter(key__in=keys, state=EntryState.WAITING)
    assert waiting.count() == 10
    why = explain.explain(waiting.order_by("pk").first())  # type: ignore[arg-type]
    assert why.blocked_by == "rate_limited"
    place = next(p for p in why.places if p.blocked_by == "rate_limited")
    # The minute's window opens a minute after the first admission (database clock; the
    # bodies' first start when there is no log).
    first_admitted = min(per_minute) if per_minute else min(s["start"] for s in spans)
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
    celery_workers: StartWorkers, mark_log: MarkLog | None
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
    admissions = mark_log(rate_tasks.SLOTS_RATE_POOL, 0) if mark_log else None
    most, rate = _check_window(spans, 20, 1.0, admissions)
    assert rate >= MIN_SHARE * 20, f"achieved {rate:.1f} starts/s of 20/s (most {most} in 1 s)"
