"""The peer harness's own logic (tests/peer/run.py), on made-up files: no services."""

from __future__ import annotations

from pathlib import Path

from tests.peer.run import Run, as_a_user_runs, differences, parse_junit, worker_checks

GOOD = "mode=pooled-4 prefetch=1 db_reuse_max=1000 fast_path=on own_connection=on"


def test_parse_junit__the_worst_outcome_of_a_repeated_case_wins(tmp_path: Path) -> None:
    """A subtest written as a case of its own (as the pytest-subtests plugin did) must not
    be hidden by the passing case of the same name that follows it."""
    junit = tmp_path / "r.xml"
    junit.write_text(
        '<testsuites><testsuite name="s">'
        '<testcase classname="t.c" name="test_a"><failure message="subtest"/></testcase>'
        '<testcase classname="t.c" name="test_a"/>'
        '<testcase classname="t.c" name="test_b"/>'
        '<testcase classname="t.c" name="test_c"><skipped type="pytest.xfail"/></testcase>'
        "</testsuite></testsuites>"
    )
    assert parse_junit(junit) == {
        "t.c::test_a": "failed",
        "t.c::test_b": "passed",
        "t.c::test_c": "xfailed",
    }


def test_worker_checks__one_line_per_worker_process(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_bytes(
        b"[.. WARNING/ForkPoolWorker-1] peer-check pid=11 " + GOOD.encode() + b"\n"
        b"[.. INFO/MainProcess] Task x received\n"
        b"[.. WARNING/ForkPoolWorker-2] peer-check pid=12 " + GOOD.encode() + b"\n"
        b"[.. WARNING/ForkPoolWorker-1] peer-check pid=11 mode=again\n"
    )
    assert worker_checks(log) == [GOOD, GOOD]
    assert worker_checks(tmp_path / "absent.log") == []


def test_as_a_user_runs__accepts_the_quick_start_worker_and_refuses_any_other() -> None:
    assert as_a_user_runs("pooled-4", [GOOD, GOOD], "on") is None
    assert as_a_user_runs("plain", [], "on") is None
    off = GOOD.replace("fast_path=on", "fast_path=off")
    assert as_a_user_runs("pooled-4", [off], "off") is None
    # Each way a pooled worker could differ from a user's is refused.
    assert "no peer-check line" in (as_a_user_runs("pooled-1", [], "on") or "")
    for wrong in (
        off,
        GOOD.replace("own_connection=on", "own_connection=off"),
        GOOD.replace("db_reuse_max=1000", "db_reuse_max=None"),
        GOOD.replace("prefetch=1", "prefetch=4"),
    ):
        assert as_a_user_runs("pooled-4", [GOOD, wrong], "on") is not None, wrong


def test_differences__a_test_missing_from_one_run_is_a_difference() -> None:
    plain = Run("plain", {"a": "passed", "b": "failed", "c": "passed"}, 0.0)
    pooled = Run("pooled-4", {"a": "failed", "b": "failed"}, 0.0)
    assert differences(plain, pooled) == {"a": ("passed", "failed"), "c": ("passed", "absent")}
