"""The benchmark's table and targets (``pools.bench.report``) and its options (``cli``)."""

from __future__ import annotations

from argparse import ArgumentParser

from pools.bench import cli, report
from pools.bench.context import EMBEDDED_SIZES, FULL_SIZES, Options


def _summary(*values: float) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": ordered[len(ordered) // 2], "min": ordered[0], "max": ordered[-1]}


def _w5(pools_back: list[float], lease: float = 30.0, ttl: float = 60.0) -> dict:
    side = {
        "throughput": _summary(10.0),
        "handoff_p50": _summary(0.01),
        "handoff_p95": _summary(0.02),
        "handoff_p99": _summary(0.03),
        "retries": _summary(0),
        "inversions": _summary(0),
        "peak": 4,
    }
    return {
        "limit": 4,
        "ttl": ttl,
        "no-op": {"pools": dict(side), "recipe": dict(side)},
        "kill": {
            "lease_seconds": lease,
            "recipe_ttl": ttl,
            "pools": _summary(*pools_back),
            "recipe": _summary(59.5),
        },
    }


def _w1_body() -> dict:
    """The figures every W1 body kind has."""
    return {k: _summary(1.0) for k in ("pooled", "plain", "ratio", "submit_pooled", "submit_plain")}


def _target(results: dict, figure: str) -> dict:
    (row,) = [t for t in report.targets(results) if t["figure"] == figure]
    return row


KILLED = "killed holder: slot back after (pools)"


def test_killed_holder__met_only_within_the_lease() -> None:
    assert _target({"W5": _w5([29.0])}, KILLED)["met"] is True
    assert _target({"W5": _w5([30.0])}, KILLED)["met"] is True
    # Lease + the sweep's delay: not within the lease.
    assert _target({"W5": _w5([30.6])}, KILLED)["met"] is False
    # Every holder must be back within the lease, not just the median one.
    assert _target({"W5": _w5([20.0, 21.0, 31.0])}, KILLED)["met"] is False


def test_killed_holder__shows_the_lease_and_the_recipe_ttl() -> None:
    results = {"W5": _w5([31.0], lease=30.0, ttl=60.0)}
    row = _target(results, KILLED)
    assert "lease 30 s" in row["target"] and "TTL 60 s" in row["target"]
    line = next(line for line in report.table(results).splitlines() if KILLED in line)
    assert "lease 30 s" in line and "TTL 60 s" in line
    assert line.endswith("NO")


def test_w5_targets__zero_retries_and_inversions_in_every_repetition() -> None:
    w5 = _w5([10.0])
    w5["no-op"]["pools"]["inversions"] = _summary(0, 0, 1)  # median 0, max 1
    results = {"W5": w5}
    assert _target(results, "no-op pools: priority inversions")["met"] is False
    assert _target(results, "no-op pools: wasted retries")["met"] is True
    assert _target(results, "no-op pools: hand-off p99")["met"] is True  # equal to the recipe's


def test_table__starts_with_the_options() -> None:
    options = Options()
    text = report.table({"command": f"pools bench {options.command_line()}"})
    first = text.splitlines()[0]
    assert first.startswith("Options: pools bench --workloads W1,W2,W3,W4,W5,memory --reps 3")
    assert f"--tasks {options.tasks}" in first and "--depths 1000,10000,100000" in first


def _parse(*argv: str, embedded: bool = False) -> Options:
    parser = ArgumentParser()
    cli.add_arguments(parser)
    return cli.options_from(vars(parser.parse_args(argv)), embedded=embedded)


def test_options__defaults_are_the_quick_sizes() -> None:
    options = _parse()
    assert options == Options()
    assert options.preset == "default"
    assert options.reps >= 3
    assert options.depths == (1000, 10000, 100000)


def test_options__the_embedded_stack_has_smaller_defaults_and_explicit_sizes_win() -> None:
    options = _parse("--tasks", "700", embedded=True)
    assert options.preset == "embedded"
    assert options.tasks == 700
    assert options.handoff_tasks == EMBEDDED_SIZES["handoff_tasks"] < Options().handoff_tasks
    assert _parse("--full", embedded=True).tasks == FULL_SIZES["tasks"]


def test_options__full_gives_the_issue_sizes_unless_a_size_is_given() -> None:
    options = _parse("--full", "--handoff-tasks", "50")
    assert options.preset == "full"
    assert options.tasks == 5000 and options.slow_tasks == 1000
    assert options.handoff_tasks == 50
    assert {k: getattr(options, k) for k in FULL_SIZES if k != "handoff_tasks"} == {
        k: v for k, v in FULL_SIZES.items() if k != "handoff_tasks"
    }
    assert _parse("--tasks", "5000").tasks == 5000


def test_options__worker_args_are_passed_on_and_shown_quoted() -> None:
    options = _parse("--worker-args=--disable-prefetch --prefetch-multiplier 1")
    assert options.worker_args == "--disable-prefetch --prefetch-multiplier 1"
    assert "--worker-args '--disable-prefetch --prefetch-multiplier 1'" in options.command_line()
    assert "--worker-args" not in Options().command_line()


def test_w1__release_lag_rows_beside_the_throughput() -> None:
    d = _w1_body()
    d.update(lag_pooled=_summary(0.03), lag_plain=_summary(0.42))
    rows = {row[1]: row for row in report._rows({"W1": {"no-op": d}})}
    assert rows["no-op: first body after the release, pooled"][2] == _summary(0.03)
    assert rows["no-op: first body after the release, plain"][2] == _summary(0.42)
    assert rows["no-op: first body after the release, plain"][3] == "ms"
    # Results written before the lag was recorded still render.
    del d["lag_pooled"], d["lag_plain"]
    assert not [r for r in report._rows({"W1": {"no-op": d}}) if "release" in r[1]]


def test_w1__stage_rows_show_where_the_hand_off_goes() -> None:
    d = _w1_body()
    d["stages"] = {
        name: {"p50": _summary(0.002), "p99": _summary(0.009)}
        for name in ("end_to_settle", "admitted_to_start", "start_to_body")
    }
    rows = {row[1]: row for row in report._rows({"W1": {"20 ms": d}})}
    assert rows["20 ms: pooled admission -> start call p99"][2] == _summary(0.009)
    assert rows["20 ms: pooled body end -> settle call p50"][3] == "ms"
    assert len([r for r in rows if "call" in r]) == 6
