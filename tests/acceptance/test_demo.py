"""``make demo`` end to end: example_project/run_demo.py on SQLite + the filesystem broker.

Runs the real script (migrate, a prefork worker with embedded beat, a burst of
pooled tasks, then a trickle bounded by ``--seconds``) in a subprocess with its own data
directory; needs no servers.
"""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "example_project" / "run_demo.py"
TASKS = 12
#: How long the demo trickles after the burst (then it drains and exits).
TRICKLE = 20
#: The demo gets this long in all; it stops its worker on SIGTERM within STOP_TIMEOUT.
RUN_TIMEOUT = 150
STOP_TIMEOUT = 15

pytestmark = pytest.mark.acceptance


def _run_demo(var_dir: Path) -> tuple[int, str]:
    # The embedded defaults, whatever the test run itself is configured with.
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in {
            "DATABASE_URL",
            "CELERY_BROKER_URL",
            "CELERY_RESULT_BACKEND",
            "DJANGO_SETTINGS_MODULE",
        }
    }
    env["EXAMPLE_VAR_DIR"] = str(var_dir)
    argv = [
        sys.executable,
        str(SCRIPT),
        "--no-serve",
        "--tasks",
        str(TASKS),
        "--seconds",
        str(TRICKLE),
        "--timeout",
        "60",
    ]
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the demo stops its worker on SIGTERM
        try:
            out, _ = proc.communicate(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        pytest.fail(f"the demo did not finish within {RUN_TIMEOUT} s:\n{out}{_log(var_dir)}")
    return proc.returncode, out


def _log(var_dir: Path) -> str:
    path = var_dir / "worker.log"
    text = path.read_text(errors="replace") if path.exists() else "(none)"
    return "\n--- worker.log (last 60 lines) ---\n" + "\n".join(text.splitlines()[-60:])


def _samples(out: str) -> list[tuple[float, dict[str, tuple[int, int]]]]:
    """The trickle's summary lines: ``(seconds, {pool: (held, waiting)})``."""
    samples = []
    for line in re.findall(r"^  \[ *(\d+) s\] (.*)$", out, re.M):
        pools = {
            m[0]: (int(m[1]), int(m[2]))
            for m in re.findall(r"(\S+) (\d+)/\d+ held (\d+) waiting", line[1])
        }
        samples.append((float(line[0]), pools))
    return samples


def test_demo_drains_a_burst_then_keeps_the_pools_contended_while_it_trickles(
    tmp_path: Path,
) -> None:
    code, out = _run_demo(tmp_path)
    assert code == 0, f"run_demo.py exited with {code}:\n{out}{_log(tmp_path)}"

    # The burst's live summary: every pool with its bar, and the running total.
    for pool in ("warehouse", "partner-api", "reports"):
        assert re.search(rf"^  {pool} +\[[#.]+\] \d+/\d+ held", out, re.M), out
    assert re.search(rf"^  \d+/{TASKS} succeeded, \d+ failed$", out, re.M), out
    final = re.search(
        r"Drained in [\d.]+ s: (\d+) succeeded, (\d+) failed, (\d+) other; "
        r"(\d+)/(\d+) results stored",
        out,
    )
    assert final, out
    assert [int(n) for n in final.groups()] == [TASKS, 0, 0, TASKS, TASKS], out

    # The trickle: contention (slots held and entries waiting) in its second half too,
    # not only right after the burst; a workflow run with its run cap among the pools.
    samples = _samples(out)
    assert len(samples) >= TRICKLE // 5, out
    late = [pools for at, pools in samples if at >= TRICKLE / 2]
    assert late, out
    contended = [
        p for p in late if sum(h for h, _ in p.values()) > 0 and sum(w for _, w in p.values()) > 0
    ]
    assert contended, out
    assert any(name.startswith("run-cap:") for _, p in samples for name in p), out
    drained = re.search(r"Trickle drained in [\d.]+ s: (\d+) succeeded, (\d+) failed", out)
    assert drained and int(drained[2]) == 0, out

    # The demo's own database agrees: every entry ran and succeeded, the burst, the
    # trickle and its workflow runs (each capped, each ending in its chord's body).
    with sqlite3.connect(tmp_path / "demo.sqlite3") as db:
        states = dict(
            db.execute(
                "SELECT state, COUNT(*) FROM pools_queueentry "
                "WHERE task_name LIKE 'demo.tasks.%' GROUP BY state"
            ).fetchall()
        )
        summaries = db.execute(
            "SELECT COUNT(*) FROM pools_queueentry WHERE task_name = 'demo.tasks.summarize' "
            "AND root_id <> ''"
        ).fetchone()[0]
    assert set(states) == {"succeeded"}, states
    assert states["succeeded"] == TASKS + int(drained[1]), (states, out)
    assert summaries >= 1

    log = (tmp_path / "worker.log").read_text(errors="replace")
    assert "database is locked" not in log
    assert "Traceback" not in log, _log(tmp_path)
