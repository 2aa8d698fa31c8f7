"""A pool's rate on body starts: a rated entry's start confirms its place in the pool's
window of starts, under the pool's lock (pools.core.starts), on every database; on
PostgreSQL's ``sql`` path each check is one stored function (``pools_start_rated``).

Windows of starts are counted with :func:`pools.bench.rates.max_in_window` on every
entry's ``started_at`` (written by the start itself, on the process's clock, after the
check: the ring of starts keeps only the last ``N``). The moments the start calls returned
in the threads are printed, not asserted: on this shared machine a thread may wait longer
for the CPU after its commit than the hand-off margin (the acceptance test checks the
bodies' own start times on real workers). The sabotage twin switches the check off and
sees more than ``N``.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
from django.db import connection
from django.db.models import F

from pools.bench.rates import max_in_window
from pools.core import admission, leases, rates, starts
from pools.models import Pool, QueueEntry, RateMark
from pools.states import EntryState
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = pytest.mark.django_db(transaction=True)

THREADS = 4


def _admitted_then_rated(pool: str, count: int, rate: str) -> list[tuple[int, int]]:
    """``count`` entries admitted at once in ``pool``, which then gets ``rate``: a backlog of
    admitted entries whose starts only the start check holds to the rate (set directly, so
    the windows of admissions stay empty: the admission side is not what is tested)."""
    make_pool(pool, rates.UNLIMITED_SLOTS)
    for i in range(count):
        submit(pool, key=f"{pool}-{i}")
    Pool.objects.filter(name=pool).update(rate=rate)
    entries = QueueEntry.objects.filter(state=EntryState.ADMITTED).order_by("pk")
    claims = list(entries.values_list("pk", "token"))
    assert len(claims) == count
    return claims


def _start_concurrently(claims: list[tuple[int, int]]) -> tuple[list[float], list[Any]]:
    """``THREADS`` threads (own connections) start the claims; the started entries'
    ``started_at`` (POSIX seconds) and what each start call returned."""
    barrier = threading.Barrier(THREADS)
    times: list[float] = []
    got: list[Any] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run(mine: list[tuple[int, int]]) -> None:
        try:
            barrier.wait()
            for entry_id, token in mine:
                result = leases.start_rated(entry_id, token, worker=f"w{entry_id}")
                now = time.time()
                with lock:
                    got.append(result)
                    if result is not None and not isinstance(result, starts.Postponed):
                        times.append(now)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(claims[n::THREADS],)) for n in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    print(f"returned: most {max_in_window(times, 1.0)[0]} in a second")
    started = QueueEntry.objects.filter(
        pk__in=[pk for pk, _ in claims], started_at__isnull=False
    ).values_list("started_at", flat=True)
    return [at.timestamp() for at in started if at is not None], got


def test_rated_starts__admissions_say_whether_a_pool_has_a_rate(
    recorder: RecordingBridge, admission_path: str
) -> None:
    make_pool("rated", rates.UNLIMITED_SLOTS, rate="5/s")
    make_pool("plain", 2)
    submit("rated", key="r")
    submit("plain", key="u")
    assert {a.key: a.rated for a in recorder.admissions} == {"r": True, "u": False}


def test_rated_starts__concurrent_starts_never_exceed_n_in_any_window(
    recorder: RecordingBridge, admission_path: str
) -> None:
    """12 admitted entries of a 4/s pool, started by 4 threads at once: no second holds
    more than 4 starts (waits of up to a second are slept through; longer ones put the
    entry back in line)."""
    claims = _admitted_then_rated("p", 12, "4/s")
    times, got = _start_concurrently(claims)
    most, _ = max_in_window(times, 1.0)
    assert 0 < most <= 4, f"{most} starts within one second (limit 4)"
    postponed = [g for g in got if isinstance(g, starts.Postponed)]
    assert len(times) + len(postponed) == 12
    assert Pool.objects.get(name="p").starts == len(times)
    # The ring of starts keeps the last N, by the database clock.
    marks = RateMark.objects.filter(pool__name="p", rate_index=rates.START_INDEX)
    assert marks.count() == min(4, len(times))


def test_rated_starts__sabotage_without_the_check_more_than_n_start_in_a_second(
    recorder: RecordingBridge, admission_path: str
) -> None:
    """The twin of the test above with the start check switched off: it can fail (the
    ORM path's check answers "now"; the stored function's margin is minus a day, so no
    window is ever full)."""
    claims = _admitted_then_rated("p", 12, "4/s")
    with (
        mock.patch.object(rates, "start_opens", return_value=None),
        mock.patch.object(rates, "HANDOFF_MARGIN", timedelta(days=-1)),
    ):
        times, _ = _start_concurrently(claims)
    assert len(times) == 12
    assert max_in_window(times, 1.0)[0] > 4


def test_rated_starts__a_long_wait_puts_the_entry_back_in_line_until_its_place_comes(
    recorder: RecordingBridge, admission_path: str
) -> None:
    """2/m: the third start's place comes in a minute. The entry goes back in line (slots
    released, not failed) and the pool admits nothing before its place comes; then it is
    admitted again and starts."""
    (a, b, c) = _admitted_then_rated("p", 3, "2/m")
    assert leases.start_rated(*a, worker="w") is not None
    assert leases.start_rated(*b, worker="w") is not None
    held = leases.start_rated(*c, worker="w")
    assert isinstance(held, starts.Postponed)
    assert 55 < held.seconds <= 60.1
    entry = QueueEntry.objects.get(pk=c[0])
    assert entry.state == EntryState.WAITING
    assert entry.reason == starts.POSTPONED
    assert Pool.objects.get(name="p").held == 2
    assert admission.admit(["p"]) == []  # its place has not come: nothing is admitted
    # A minute passes (both rings aged): admitted again, and it starts.
    RateMark.objects.filter(pool__name="p").update(at=F("at") - timedelta(seconds=61))
    again = admission.admit(["p"])
    assert [x.entry_id for x in again] == [c[0]]
    assert again[0].rated
    assert leases.start_rated(c[0], again[0].token, worker="w") is not None
    assert Pool.objects.get(name="p").starts == 3


def test_rated_starts__a_stale_token_is_refused_without_a_mark(
    recorder: RecordingBridge, admission_path: str
) -> None:
    ((entry_id, token),) = _admitted_then_rated("p", 1, "2/s")
    assert leases.start_rated(entry_id, token + 1, worker="w") is None
    assert Pool.objects.get(name="p").starts == 0
    assert not RateMark.objects.filter(pool__name="p", rate_index__gte=rates.START_INDEX)


def test_rated_starts__changing_the_rates_forgets_the_windows_of_starts(
    recorder: RecordingBridge,
) -> None:
    from pools.core import pool_crud

    ((entry_id, token),) = _admitted_then_rated("p", 1, "2/s")
    assert leases.start_rated(entry_id, token, worker="w") is not None
    assert RateMark.objects.filter(pool__name="p", rate_index=rates.START_INDEX).exists()
    pool_crud.update_pool("p", rate="3/s")
    assert not RateMark.objects.filter(pool__name="p").exists()


def test_rated_starts__an_unrated_pool_on_the_rated_path_starts_at_once(
    recorder: RecordingBridge,
) -> None:
    """A rate removed between admission and start: the start has nothing to wait for."""
    make_pool("plain", 1)
    submit("plain", key="u")
    entry = QueueEntry.objects.get(key="u")
    assert leases.start_rated(entry.pk, entry.token, worker="w") is not None
    assert Pool.objects.get(name="plain").starts == 0
