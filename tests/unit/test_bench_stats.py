"""The benchmark's pure counting (``pools.bench.stats``): no database, no Celery, no clock."""

from __future__ import annotations

import itertools
import random

import pytest

from pools.bench import stats
from pools.bench.comparison import recipe_order


def test_percentile__nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert stats.percentile(values, 50) == 50.0
    assert stats.percentile(values, 99) == 99.0
    assert stats.percentile([3.0], 99) == 3.0


def test_throughput__clock_runs_from_the_first_start_to_the_last_end() -> None:
    # Released at 10.0; the first body starts 0.5 s later (e.g. add_consumer's lag).
    spans = [
        {"s": 10.5, "e": 11.0},
        {"s": 11.0, "e": 12.0},
        {"s": 11.5, "e": 12.5},
        {"s": 12.0, "e": 12.1},
    ]
    assert stats.throughput(spans) == pytest.approx(4 / 2.0)
    assert stats.start_lag(spans, 10.0) == pytest.approx(0.5)
    assert stats.throughput([]) == 0.0
    assert stats.start_lag([], 10.0) == 0.0


def test_stages__split_each_task_by_its_entry_times() -> None:
    spans = [{"i": 0, "s": 10.010, "e": 10.030}, {"i": 1, "s": 10.050, "e": 10.060}]
    # (admitted, start call, settle call) of each entry; body 2 has no entry times.
    times = {0: (10.000, 10.008, 10.032), 1: (10.032, 10.047, 10.061)}
    got = stats.stages([*spans, {"i": 2, "s": 11.0, "e": 11.1}], times)
    assert set(got) == set(stats.STAGES)
    assert got["end_to_settle"] == pytest.approx([0.002, 0.001])
    assert got["admitted_to_start"] == pytest.approx([0.008, 0.015])
    assert got["start_to_body"] == pytest.approx([0.002, 0.003])


def test_stage_summary__p50_and_p99_of_each_repetition_summarised() -> None:
    fast = {name: [0.001] * 99 + [0.010] for name in stats.STAGES}
    slow = {name: [0.003] * 100 for name in stats.STAGES}
    got = stats.stage_summary([fast, slow])
    assert got["admitted_to_start"]["p50"] == {"median": 0.002, "min": 0.001, "max": 0.003}
    assert got["admitted_to_start"]["p99"] == {"median": 0.002, "min": 0.001, "max": 0.003}
    assert stats.stage_summary([]) == {}


def test_serial_gaps__one_gap_between_each_pair_in_start_order() -> None:
    spans = [
        {"i": 1, "s": 2.0, "e": 2.5},
        {"i": 0, "s": 0.0, "e": 1.0},
        {"i": 2, "s": 3.0, "e": 3.1},
    ]
    assert stats.serial_gaps(spans) == [1.0, 0.5]
    assert stats.gaps_after(spans, {0: 1.5, 1: 2.75}) == [0.5, 0.25]


def test_handoff_gaps__release_matched_to_next_acquire() -> None:
    # Two slots: 0 and 1 start at once; 2 takes the slot 0 freed, 3 the slot 1 freed.
    spans = [
        {"s": 0.0, "e": 1.0},
        {"s": 0.0, "e": 2.0},
        {"s": 1.5, "e": 3.0},
        {"s": 2.25, "e": 4.0},
    ]
    assert stats.handoff_gaps(spans) == [0.5, 0.25]


def test_max_concurrency__touching_intervals_do_not_overlap() -> None:
    assert stats.max_concurrency([{"s": 0, "e": 1}, {"s": 1, "e": 2}]) == 1
    assert stats.max_concurrency([{"s": 0, "e": 2}, {"s": 1, "e": 3}, {"s": 1.5, "e": 4}]) == 3


def test_check_complete__missing_and_duplicated_bodies_fail() -> None:
    stats.check_complete([{"i": 0}, {"i": 1}], range(2))
    with pytest.raises(AssertionError, match="1 missing"):
        stats.check_complete([{"i": 0}], range(2))
    with pytest.raises(AssertionError, match="1 duplicated"):
        stats.check_complete([{"i": 0}, {"i": 0}], range(2))


# --------------------------------------------------------------------------- inversions
# Items are (priority, queued, acquired); all queued at 0 unless a test says otherwise.


def _in_order(*priorities: int) -> list[tuple[int, float, float]]:
    """Tasks all queued at 0 that acquired in the given order (acquired at 1, 2, ...)."""
    return [(p, 0.0, float(n + 1)) for n, p in enumerate(priorities)]


def test_inversions__priority_order_has_none() -> None:
    assert stats.inversions(_in_order(10, 10, 5, 0, 0)) == 0


def test_inversions__equal_priorities_in_any_order_have_none() -> None:
    assert stats.inversions(_in_order(5, 5, 5, 5)) == 0
    assert stats.inversions([]) == 0


def test_inversions__one_low_acquisition_before_waiting_higher_ones_counts_once() -> None:
    # The 0 took a slot while both 10s waited: one inverted acquisition, not two.
    assert stats.inversions(_in_order(0, 10, 10)) == 1


def test_inversions__each_overtaking_acquisition_counts() -> None:
    # 0 overtakes 5 and 10; 5 then overtakes 10; 10 overtakes nobody.
    assert stats.inversions(_in_order(0, 5, 10)) == 2
    # Two low ones first, then the high ones: both low acquisitions are inversions.
    assert stats.inversions(_in_order(0, 0, 10, 5)) == 2
    # Interleaved: 5 (10 waits), 10, 0 (5 still waits), 5.
    assert stats.inversions(_in_order(5, 10, 0, 5)) == 2


def test_inversions__a_higher_task_not_yet_queued_is_not_waiting() -> None:
    # The 10 was queued after the 0 acquired (3 > 1), or exactly when it did (1 == 1).
    assert stats.inversions([(0, 0.0, 1.0), (10, 3.0, 4.0)]) == 0
    assert stats.inversions([(0, 0.0, 1.0), (10, 1.0, 4.0)]) == 0
    # Queued just before: it waited.
    assert stats.inversions([(0, 0.0, 1.0), (10, 0.5, 4.0)]) == 1


def test_inversions__a_higher_task_that_already_acquired_is_not_waiting() -> None:
    assert stats.inversions([(10, 0.0, 1.0), (0, 0.0, 2.0)]) == 0


def test_inversions__acquisitions_at_the_same_point_are_not_counted_against_each_other() -> None:
    assert stats.inversions([(0, 0.0, 1.0), (10, 0.0, 1.0)]) == 0
    # ... but a higher one acquiring later still counts against both.
    assert stats.inversions([(0, 0.0, 1.0), (5, 0.0, 1.0), (10, 0.0, 2.0)]) == 2


def test_inversions__input_order_does_not_matter() -> None:
    items = _in_order(0, 5, 10, 0, 10, 5, 5, 0)
    expected = stats.inversions(items)
    assert expected == 3  # the first 0, the first 5, the second 0
    rng = random.Random(7)
    for _ in range(20):
        shuffled = items[:]
        rng.shuffle(shuffled)
        assert stats.inversions(shuffled) == expected


def _reference(items: list[tuple[int, float, float]]) -> int:
    """The definition, literally: quadratic."""
    return sum(any(pj > pi and qj < ai < aj for pj, qj, aj in items) for pi, _qi, ai in items)


def test_inversions__matches_the_definition_on_random_sequences() -> None:
    rng = random.Random(11)
    for _ in range(300):
        n = rng.randint(0, 30)
        items = []
        for _ in range(n):
            queued = rng.choice([0.0, float(rng.randint(0, 20))])
            acquired = queued + rng.randint(0, 20)  # ties on purpose
            items.append((rng.choice((0, 5, 10)), queued, float(acquired)))
        assert stats.inversions(items) == _reference(items), items


def test_inversions__every_permutation_of_three_levels() -> None:
    for order in itertools.permutations((0, 5, 10)):
        items = _in_order(*order)
        assert stats.inversions(items) == _reference(items)


# --------------------------------------------------------------------------- W5 orders


def test_recipe_order__uses_the_semaphore_counter_and_the_submit_mark() -> None:
    prio = {0: 0, 1: 10, 2: 5}
    # Bodies report their acquisition number "n"; their clocks ("a") disagree with it.
    spans = [
        {"i": 0, "n": 8, "a": 99.0},
        {"i": 1, "n": 9, "a": 100.0},
        {"i": 2, "n": 10, "a": 98.0},
    ]
    order = recipe_order(spans, prio, mark=7)
    assert order["source"] == "semaphore acquisition counter"
    assert sorted(order["items"]) == [(0, 7.0, 8.0), (5, 7.0, 10.0), (10, 7.0, 9.0)]
    # 0 first (10 and 5 waited), 10, then 5: one inversion. The clocks say 5, 0, 10: two.
    assert stats.inversions(order["items"]) == 1
    timed = recipe_order([{k: v for k, v in s.items() if k != "n"} for s in spans], prio, 7)
    assert timed["source"] == "acquire timestamps"
    assert stats.inversions(timed["items"]) == 2
