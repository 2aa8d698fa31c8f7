"""``manage.py pools bench`` in miniature: real workers, tiny sizes, one repetition.

Checks the benchmark's counting (every task counted once, N-1 hand-off gaps, the depth it
claims, retries and inversions tallied, the kill test's outcome, the JSON and the clean-up),
never its timings. The pure counting helpers are checked first, without services. The run
takes about 35 s here (three workers, a 3 s lease for the kill test); every step of it gives
up after 45 s.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import connection

from pools.bench import stats
from pools.models import Pool, QueueEntry
from tests.conftest import IN_CI

# --------------------------------------------------------------------------- pure counting


def test_stats_percentile__nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert stats.percentile(values, 50) == 50.0
    assert stats.percentile(values, 99) == 99.0
    assert stats.percentile([3.0], 99) == 3.0


def test_stats_serial_gaps__one_gap_between_each_pair_in_start_order():
    spans = [
        {"i": 1, "s": 2.0, "e": 2.5},
        {"i": 0, "s": 0.0, "e": 1.0},
        {"i": 2, "s": 3.0, "e": 3.1},
    ]
    assert stats.serial_gaps(spans) == [1.0, 0.5]
    assert stats.gaps_after(spans, {0: 1.5, 1: 2.75}) == [0.5, 0.25]


def test_stats_handoff_gaps__release_matched_to_next_acquire():
    # Two slots: 0 and 1 start at once; 2 takes the slot 0 freed, 3 the slot 1 freed.
    spans = [
        {"s": 0.0, "e": 1.0},
        {"s": 0.0, "e": 2.0},
        {"s": 1.5, "e": 3.0},
        {"s": 2.25, "e": 4.0},
    ]
    assert stats.handoff_gaps(spans) == [0.5, 0.25]


def test_stats_max_concurrency__touching_intervals_do_not_overlap():
    assert stats.max_concurrency([{"s": 0, "e": 1}, {"s": 1, "e": 2}]) == 1
    assert stats.max_concurrency([{"s": 0, "e": 2}, {"s": 1, "e": 3}, {"s": 1.5, "e": 4}]) == 3


def test_stats_inversions__lower_priority_acquiring_before_a_waiting_higher_one():
    assert stats.inversions([(10, 1.0), (5, 2.0), (0, 3.0)]) == 0
    # The priority-0 task took a slot at 1.0 while the priority-10 one waited until 2.0.
    assert stats.inversions([(0, 1.0), (10, 2.0), (10, 3.0)]) == 1
    # Same admission instant: not an inversion.
    assert stats.inversions([(0, 1.0), (10, 1.0)]) == 0


def test_stats_check_complete__missing_and_duplicated_bodies_fail():
    stats.check_complete([{"i": 0}, {"i": 1}], range(2))
    with pytest.raises(AssertionError, match="1 missing"):
        stats.check_complete([{"i": 0}], range(2))
    with pytest.raises(AssertionError, match="1 duplicated"):
        stats.check_complete([{"i": 0}, {"i": 0}], range(2))


# --------------------------------------------------------------------------- the smoke run


def _need_redis() -> None:
    urls = (settings.CELERY_BROKER_URL, settings.CELERY_RESULT_BACKEND)
    if all(str(u).startswith("redis://") for u in urls):
        return
    message = f"the bench smoke run needs a Redis broker and result backend, got {urls}"
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.acceptance
@pytest.mark.django_db(transaction=True)
def test_bench_smoke__counts_every_task_and_cleans_up(tmp_path: Path, monkeypatch, settings):
    _need_redis()
    import redis

    redis.Redis.from_url(settings.CELERY_BROKER_URL).flushdb()  # the test broker database
    # Workers read the test database and short leases (so the kill test is quick).
    monkeypatch.setenv("POOLS_PG_NAME", connection.settings_dict["NAME"])
    monkeypatch.setenv("POOLS_LEASE_SECONDS", "3")
    monkeypatch.setenv("POOLS_SWEEP_SECONDS", "1")
    settings.POOLS = {**settings.POOLS, "LEASE_SECONDS": 3.0, "SWEEP_SECONDS": 1.0}
    out = io.StringIO()
    call_command(
        "pools",
        "bench",
        "--out", str(tmp_path),
        "--workloads", "W1,W2,W3,W5",
        "--reps", "1",
        "--tasks", "40",
        "--slow-tasks", "16",
        "--handoff-tasks", "12",
        "--depths", "20,50",
        "--depth-tasks", "16",
        "--recipe-tasks", "16",
        "--recipe-ttl", "2",
        "--submit-sample", "5",
        "--timeout", "45",
        stdout=out,
    )  # fmt: skip

    result = json.loads((tmp_path / "bench.json").read_text())
    assert "W1" in out.getvalue() and "bench.json" in out.getvalue()

    w1 = result["W1"]
    assert w1["no-op"]["reps"]["completed"] == [40]
    assert w1["20 ms"]["reps"]["completed"] == [16]
    assert max(w1["20 ms"]["reps"]["peak"]) <= w1["slots"]

    w2 = result["W2"]
    assert w2["gaps_per_rep"] == [11]
    assert {k: len(v) for k, v in w2["samples"].items()} == {
        "settle_to_start": 11,
        "end_to_start": 11,
        "floor_end_to_start": 11,
    }
    assert w2["peak"] == 1  # one slot: never two bodies at once

    w3 = result["W3"]
    assert w3["depths"]["20"]["waiting"] == [20]
    assert w3["depths"]["50"]["waiting"] == [50]
    assert w3["ratio_of"] == "50/20"

    w5 = result["W5"]
    for body in ("no-op", "20 ms"):
        pools_side, recipe_side = w5[body]["pools"], w5[body]["recipe"]
        assert [r["retries"] for r in pools_side["reps"]] == [0]
        assert [r["inversions"] for r in pools_side["reps"]] == [0]
        assert [r["deliveries"] for r in pools_side["reps"]] == [16]
        assert pools_side["peak"] <= w5["limit"] and recipe_side["peak"] <= w5["limit"]
        assert recipe_side["retries"]["median"] >= 0
    kill = w5["kill"]
    assert kill["holders"] == 1
    assert kill["pools_killed_task_ran_again"] == 1
    assert kill["recipe_killed_task_lost"] == 1
    assert len(kill["pools"]["reps"]) == len(kill["recipe"]["reps"]) == 1

    pytest.importorskip("matplotlib")
    assert {p.name for p in tmp_path.glob("*.png")} >= {"w1-throughput.png", "w2-handoff.png"}

    # Clean-up: the bench's pools and entries are gone, the project's own pools are kept.
    assert not Pool.objects.filter(name__startswith="bench-").exists()
    assert not QueueEntry.objects.filter(task_name__startswith="pools.bench.").exists()
