"""The sliding-window checker of the rate benchmark and acceptance tests (no database)."""

from __future__ import annotations

import math

from pools.bench.rates import achieved_rate, max_in_window, window_report


def test_max_in_window__windows_are_half_open() -> None:
    assert max_in_window([0.0, 0.5, 0.99, 1.0, 1.5], 1.0) == (3, 0.0)
    assert max_in_window([0.0, 1.0, 2.0], 1.0)[0] == 1


def test_max_in_window__finds_the_busiest_window_anywhere() -> None:
    times = [0.0, 0.9, 1.05, 1.1, 1.2, 1.8, 3.0]
    assert max_in_window(times, 1.0) == (5, 0.9)
    assert max_in_window(list(reversed(times)), 1.0) == (5, 0.9)


def test_max_in_window__nothing() -> None:
    most, at = max_in_window([], 1.0)
    assert most == 0 and math.isnan(at)


def test_achieved_rate__bursts_and_even_spacing_both_give_the_limit() -> None:
    bursts = [float(w) for w in range(15) for _ in range(20)]  # 20 at once, each second
    even = [n / 20 for n in range(300)]  # one every 50 ms
    assert achieved_rate(bursts, 1.0) == 20.0
    assert achieved_rate(even, 1.0) == 20.0


def test_achieved_rate__less_than_a_window_is_not_a_rate() -> None:
    assert math.isnan(achieved_rate([0.0, 0.5], 1.0))
    assert math.isnan(achieved_rate([1.0], 1.0))


def test_window_report__an_overshooting_run() -> None:
    starts = [n / 40 for n in range(120)]  # 40/s for 3 s against a limit of 20/s
    report = window_report(starts, 20, 1.0)
    assert report["max_in_window"] == 40
    assert report["achieved_per_s"] == 40.0 and report["achieved_share"] == 2.0
