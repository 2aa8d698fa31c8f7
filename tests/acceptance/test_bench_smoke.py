"""``manage.py pools bench`` in miniature: real workers, tiny sizes, one repetition.

Checks the benchmark's counting (every task counted once, N-1 hand-off gaps, the depth it
claims, retries and inversions tallied from the admission / acquisition order, the kill
test's outcome and its target, the JSON and the clean-up), never its timings. The pure
counting is in ``tests/unit/test_bench_stats.py``. The run takes about 35 s here (three
workers, a 3 s lease for the kill test); every step of it gives up after 45 s.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import connection
from pytest_django import Settings

from pools.models import Pool, QueueEntry
from tests.conftest import IN_CI

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
def test_bench_smoke__counts_every_task_and_cleans_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settings: Settings
) -> None:
    _need_redis()
    import redis

    redis.Redis.from_url(settings.CELERY_BROKER_URL).flushdb()  # the test broker database
    # Workers read the test database and short leases (so the kill test is quick).
    monkeypatch.setenv("POOLS_PG_NAME", connection.settings_dict["NAME"])
    monkeypatch.setenv("POOLS_LEASE_SECONDS", "3")
    monkeypatch.setenv("POOLS_SWEEP_SECONDS", "1")
    settings.POOLS = {**settings.POOLS, "LEASE_SECONDS": 3.0, "SWEEP_SECONDS": 1.0}
    from celery import current_app

    routes = current_app.conf.task_routes
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
        "--worker-args=--disable-prefetch",
        stdout=out,
    )  # fmt: skip
    # The run routed this process's wake-ups to the bench queue; later tests need them back
    # on the default queue (test_transparency's countdown call waited 60 s for one).
    assert current_app.conf.task_routes == routes

    result = json.loads((tmp_path / "bench.json").read_text())
    table = out.getvalue()
    assert "W1" in table and "bench.json" in table
    assert table.startswith("Options: pools bench --workloads W1,W2,W3,W5 --reps 1 --tasks 40")
    assert result["options"]["tasks"] == 40 and result["options"]["depths"] == [20, 50]

    w1 = result["W1"]
    assert w1["no-op"]["reps"]["completed"] == [40]
    assert w1["20 ms"]["reps"]["completed"] == [16]
    assert max(w1["20 ms"]["reps"]["peak"]) <= w1["slots"]
    assert result["options"]["worker_args"] == "--disable-prefetch"
    if Path("/proc/stat").exists():  # CPU accounting reads /proc
        cpu = w1["no-op"]["cpu_ms_per_task"]
        groups = {"celery main", "pool processes", "postgres", "redis", "machine"}
        assert set(cpu["plain"]) == set(cpu["pooled"]) == groups
        # The bodies ran in the workers' pool processes, and the machine was busy with them.
        assert cpu["pooled"]["pool processes"] > 0 and cpu["plain"]["pool processes"] > 0
        assert cpu["pooled"]["machine"] >= cpu["pooled"]["pool processes"]
        assert cpu["pooled"]["postgres"] > 0  # start and settle are database calls
    # Every pooled task writes its start and settle to PostgreSQL's write-ahead log.
    for body in ("no-op", "20 ms"):
        # Every task's entry gave its stages; each stage is a positive time, and the body
        # of a 20 ms task is not in any of them.
        stages = w1[body]["stages"]
        assert set(stages) == {"end_to_settle", "admitted_to_start", "start_to_body"}
        for stage in stages.values():
            assert 0 < stage["p50"]["median"] <= stage["p99"]["median"] < 5
        assert w1[body]["lag_pooled"]["median"] > 0 and w1[body]["lag_plain"]["median"] > 0
    assert len(w1["no-op"]["reps"]["wal_bytes"]) == 1
    assert w1["no-op"]["wal_bytes"]["median"] > 500

    w2 = result["W2"]
    assert w2["gaps_per_rep"] == [11]
    assert {k: len(v) for k, v in w2["samples"].items()} == {
        "settle_to_start": 11,
        "end_to_start": 11,
        "floor_end_to_start": 11,
    }
    assert w2["peak"] == 1  # one slot: never two bodies at once
    assert set(w2["stages"]) == {"end_to_settle", "admitted_to_start", "start_to_body"}

    w3 = result["W3"]
    assert w3["depths"]["20"]["waiting"] == [20]
    assert w3["depths"]["50"]["waiting"] == [50]
    assert w3["ratio_of"] == "50/20"

    w5 = result["W5"]
    for body in ("no-op", "20 ms"):
        pools_side, recipe_side = w5[body]["pools"], w5[body]["recipe"]
        assert [r["retries"] for r in pools_side["reps"]] == [0]
        assert [r["inversions"] for r in pools_side["reps"]] == [0]
        assert pools_side["inversions_from"] == ["admission order (admission_seq)"]
        assert recipe_side["inversions_from"] == ["semaphore acquisition counter"]
        assert 0 <= recipe_side["inversions"]["max"] < 16
        assert [r["deliveries"] for r in pools_side["reps"]] == [16]
        assert pools_side["peak"] <= w5["limit"] and recipe_side["peak"] <= w5["limit"]
        assert recipe_side["retries"]["median"] >= 0
    kill = w5["kill"]
    assert kill["holders"] == 1
    assert kill["pools_killed_task_ran_again"] == 1
    assert kill["recipe_killed_task_lost"] == 1
    assert len(kill["pools"]["reps"]) == len(kill["recipe"]["reps"]) == 1
    (target,) = [t for t in result["targets"] if t["figure"].startswith("killed holder")]
    assert kill["lease_seconds"] == 3
    assert target["met"] is (kill["pools"]["max"] <= 3)  # back within the lease, or not met
    assert "lease 3 s" in target["target"] and "TTL 2 s" in target["target"]

    pytest.importorskip("matplotlib")
    assert {p.name for p in tmp_path.glob("*.png")} >= {"w1-throughput.png", "w2-handoff.png"}

    # Clean-up: the bench's pools and entries are gone, the project's own pools are kept.
    assert not Pool.objects.filter(name__startswith="bench-").exists()
    assert not QueueEntry.objects.filter(task_name__startswith="pools.bench.").exists()
