"""Run Celery's own integration tests plain and pooled, and print the differences.

    python -m tests.peer.run                      # full: canvas + tasks, plain / pooled-4 / pooled-1
    python -m tests.peer.run --subset             # the bounded subset ``make test`` runs
    python -m tests.peer.run --modes plain,pooled-1 -k chord
    python -m tests.peer.run --suites canvas --fast-path off   # the ORM path, to compare

Steps: fetch ``celery==<installed version>`` from the package index as an sdist
(``pip download --no-binary :all: --no-deps``) and extract its ``t/`` tree into
``.cache/peer/``; append :mod:`tests.peer.overrides` to its integration conftest (an
external worker instead of the in-process one); then for each mode start one external
prefork worker (:mod:`tests.peer.worker_app`) on Redis, run the suites with pytest, and
stop it. Pooled modes put every task of the suite in one pool (``POOLS["TASKS"]``) of
4 or 1 slots, on PostgreSQL, in a worker set up as a user's project is (docs/quickstart.md:
configuration from Django's settings, the SQL fast path and pools' own connection on,
``CELERY_DB_REUSE_MAX``); each pooled worker process reports how it reaches the database
(a ``peer-check`` log line) and a run whose worker did not run that way is an error, not
a result. Tests that differ from the plain run are run again, alone, in both modes; a
difference that holds is reported and makes the exit status 1; one that does not hold is
still listed (``unconfirmed`` in the report), never dropped silently.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import IO
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "peer"
SUITES = {"canvas": "t/integration/test_canvas.py", "tasks": "t/integration/test_tasks.py"}
MODES = {"plain": 0, "pooled-4": 4, "pooled-1": 1}
BROKER = os.environ.get("POOLS_PEER_BROKER", "redis://127.0.0.1:6379/8")
# Celery's suite reads chord keys from Redis db 0 itself (get_redis_connection): the
# result backend must be there.
BACKEND = os.environ.get("POOLS_PEER_BACKEND", "redis://127.0.0.1:6379/0")
MARKER = "# --- django-celery-pools peer harness ---"
PEER_CHECK = re.compile(rb"peer-check pid=(\d+) (.*)")

#: What ``make test`` runs: the cases behind the defects this harness found, and a
#: spread of chains, groups, chords, retries, ETAs and expiry (about 10 minutes here).
SUBSET = {
    "canvas": [
        # bytes arguments in callbacks and errbacks enqueued by the worker (the held
        # arguments shown as text broke the fast path's replies; -k also selects
        # ..._from_chain_tail and ..._from_group_fail_multiple)
        "test_callback_called_by_group",
        "test_immutable_errback_called_by_chord_from_simple",
        "test_immutable_errback_called_by_chord_from_chain",
        "test_immutable_errback_called_by_chord_from_group",
        "test_chord_on_error",
        "test_link_error_callback_retries",
        "test_group_or_task_countdown_delays_header",
        "test_group_chain",
        "test_chain_error_handler_with_eta",
        "test_chain_with_eb_replaced_with_chain_with_eb",
        "test_nested_group_chain",
        "test_chord_header_task_replaced_with_chain",
        "test_add_to_chord",
        "test_parent_ids",
        "test_chain_child_replaced_with_chain_last",
        "test_chord_order",
        "test_simple_chain",
        "test_complex_chain",
        "test_chain_on_error",
        "test_eager_chain_inside_task",
        "test_chain_of_nine_chords",
        "test_replace_chain_with_empty_chain",
        "test_task_replaced_with_chain",
        "test_group_lone",
        "test_nested_group_group",
        "test_nested_group_chord_counting_mixed",
        "test_task_replace_with_group_preserves_group_order",
        "test_parallel_chords",
        "test_nested_chord",
        "test_priority",
        "test_error_propagates_to_chord_from_chain",
        "test_chord_body_task_replaced_with_chain",
        "test_empty_header_chord",
        "test_mutable_errback_with_stored_arguments",
        "test_link_error_using_signature",
        "test_rebuild_nested_chord_chord",
        "test_stamps_remain_on_task_retry",
        "test_starmap_in_a_group_and_a_chain",
    ],
    "tasks": [
        "test_basic_task",
        "test_task_accepted",
        "test_task_retried_once",
        "test_task_retried_priority",
        "test_task_retried_headers",
        "test_eta",
        "test_expired",
        "test_ignore_result",
        "test_properties",
        "test_class_based_task_retried",
        "test_retry_with_unpickleable_exception",
        "test_reject_with_requeue_redelivers_and_succeeds",
        "test_reject_without_requeue_stores_failure",
        "test_pydantic_model_arguments",
        "test_simple_call",
        "test_fail",
        "test_wrong_arguments",
        "test_retry_switches_from_kwargs_to_args",
        "test_unicode_task",
        "test_request_time_limits_set_via_apply_async",
        "test_apply_nested_parent_child_relationship",
        "test_asyncresult_get_cancels_subscription",
        "test_concurrent_apply_async_with_timeout",
        # app.control.purge() between canvases (the fixture's wait_until_idle): pooled
        # calls still waiting survived it and ran, so the test outran its 20 s budget
        "test_revoked_by_headers_complex_canvas",
    ],
}


@dataclass
class Run:
    mode: str
    outcomes: dict[str, str]
    seconds: float
    #: What each pooled worker process said about itself (``peer-check`` lines).
    checks: list[str] = field(default_factory=list)


def celery_version() -> str:
    return metadata.version("celery")


def fetch_suite(version: str) -> Path:
    """Extract ``t/`` (and Celery's pytest configuration) of the sdist into the cache."""
    target = CACHE / f"celery-{version}"
    if (target / "t" / "integration" / "test_canvas.py").exists():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-binary",
                ":all:",
                "--no-deps",
                f"celery=={version}",
                "-d",
                tmp,
            ],
            check=True,
        )
        (sdist,) = Path(tmp).glob("celery-*.tar.gz")
        prefix = f"celery-{version}/"
        with tarfile.open(sdist) as tar:
            members = [
                m
                for m in tar.getmembers()
                if m.name.startswith(prefix + "t/") or m.name == prefix + "pyproject.toml"
            ]
            tar.extractall(CACHE, members=members, filter="data")
    return target


def patch_conftest(root: Path) -> None:
    """Append the overrides (external worker, pools set-up) to the suite's conftest once."""
    conftest = root / "t" / "integration" / "conftest.py"
    text = conftest.read_text()
    if MARKER not in text:
        conftest.write_text(
            f"{text}\n\n{MARKER}\nfrom tests.peer.overrides import celery_session_worker  # noqa\n"
        )


def env_for(root: Path, mode: str, tasks_file: Path, fast_path: str = "on") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    backend = urlparse(BACKEND)
    env.update(
        PYTHONPATH=f"{root}{os.pathsep}{ROOT}",
        TEST_BROKER=BROKER,
        TEST_BACKEND=BACKEND,
        # The suite reads chord keys from this Redis itself (get_redis_connection).
        REDIS_HOST=backend.hostname or "127.0.0.1",
        REDIS_PORT=str(backend.port or 6379),
        POOLS_PEER_MODE=mode,
        POOLS_PEER_SLOTS=str(MODES[mode] or 1),
        POOLS_PEER_TASKS=str(tasks_file),
        POOLS_PEER_FAST_PATH=fast_path,
    )
    if mode != "plain":
        env["DJANGO_SETTINGS_MODULE"] = "tests.peer.settings"
    return env


def list_tasks(root: Path, out: Path) -> list[str]:
    """Every task name of the suite (written to ``out`` for :mod:`tests.peer.settings`)."""
    code = (
        "import json, sys; from celery import Celery; app = Celery(set_as_current=False); "
        "import t.integration.tasks as m; app.register_task(m.ClassBasedAutoRetryTask); "
        "app.finalize(auto=True); "
        "print(json.dumps(sorted(n for n in app.tasks if not n.startswith('celery.'))))"
    )
    env = env_for(root, "plain", out)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, check=True, capture_output=True, text=True
    )
    names: list[str] = json.loads(done.stdout)
    out.write_text(json.dumps(names))
    return names


def python_in(env: dict[str, str], root: Path, code: str) -> None:
    subprocess.run([sys.executable, "-c", code], env=env, cwd=root, check=True)


def reset_database(root: Path, env: dict[str, str]) -> None:
    """A new peer database, migrated; ``migrate`` creates the pool with this mode's slots."""
    python_in(
        env,
        root,
        "import psycopg, os\n"
        "name = os.environ.get('POOLS_PEER_DB', 'pools_peer')\n"
        "with psycopg.connect('host=127.0.0.1 user=postgres dbname=postgres', autocommit=True) as c:\n"
        "    c.execute(f'DROP DATABASE IF EXISTS {name} WITH (FORCE)')\n"
        "    c.execute(f'CREATE DATABASE {name}')\n",
    )
    subprocess.run(
        [sys.executable, "-m", "django", "migrate", "-v", "0"], env=env, cwd=root, check=True
    )


def flush_redis() -> None:
    import redis

    for url in (BROKER, BACKEND):
        redis.Redis.from_url(url).flushdb()


def start_worker(
    root: Path, env: dict[str, str], mode: str, concurrency: int, log: Path
) -> tuple[subprocess.Popen[bytes], IO[bytes]]:
    handle = log.open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.peer.worker_app",
            "worker",
            "-P",
            "prefork",
            "-c",
            str(concurrency),
            "-l",
            "info",
            "-n",
            f"peer-{mode}@%h",
            "--without-gossip",
            "--without-mingle",
        ],
        env=env,
        cwd=root,
        stdout=handle,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the {mode} worker exited at start; see {log}")
        if b" ready." in log.read_bytes():
            return proc, handle
        time.sleep(0.5)
    stop_worker(proc, handle)
    raise SystemExit(f"the {mode} worker did not become ready in 90 s; see {log}")


def stop_worker(proc: subprocess.Popen[bytes], handle: IO[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    handle.close()


#: When one test has several ``testcase`` elements (subtests written as cases of their
#: own, as the pytest-subtests plugin did), the worst outcome is the test's.
_RANK = {"failed": 3, "passed": 2, "xfailed": 1, "skipped": 0}


def parse_junit(path: Path) -> dict[str, str]:
    outcomes: dict[str, str] = {}
    if not path.exists():
        return outcomes
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped" and outcome != "failed":
                outcome = "xfailed" if "xfail" in (child.get("type") or "") else "skipped"
        if _RANK[outcome] >= _RANK.get(outcomes.get(name, "skipped"), 0):
            outcomes[name] = outcome
    return outcomes


def worker_checks(log: Path) -> list[str]:
    """The ``peer-check`` lines of a worker log, one per worker process that ran a task."""
    seen: dict[bytes, str] = {}
    for match in PEER_CHECK.finditer(log.read_bytes() if log.exists() else b""):
        seen.setdefault(match.group(1), match.group(2).decode().strip())
    return list(seen.values())


def as_a_user_runs(mode: str, checks: list[str], fast_path: str) -> str | None:
    """Why a pooled worker did not run as a user's project does, or None when it did."""
    if mode == "plain":
        return None
    if not checks:
        return "no worker process reported how it reaches the database (no peer-check line)"
    want = {"fast_path": fast_path, "own_connection": "on", "db_reuse_max": "1000",
            "prefetch": "1"}  # fmt: skip
    for line in checks:
        got = dict(item.split("=", 1) for item in line.split() if "=" in item)
        wrong = {k: got.get(k) for k, v in want.items() if got.get(k) != v}
        if wrong:
            return f"a worker process ran with {wrong}, expected {want}: {line}"
    return None


def run_mode(
    root: Path,
    mode: str,
    files: list[str],
    selection: str | None,
    args: argparse.Namespace,
    tasks_file: Path,
    tag: str,
) -> Run:
    env = env_for(root, mode, tasks_file, args.fast_path)
    out = CACHE / "runs"
    out.mkdir(parents=True, exist_ok=True)
    if mode != "plain":
        reset_database(root, env)
    flush_redis()
    log = out / f"{tag}-{mode}-worker.log"
    proc, handle = start_worker(root, env, mode, args.concurrency, log)
    junit = out / f"{tag}-{mode}.xml"
    junit.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:django",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:rerunfailures",
        "-p",
        "celery.contrib.pytest",
        "-c",
        str(root / "pyproject.toml"),
        "--rootdir",
        str(root),
        "-o",
        "addopts=--strict-markers",
        "--timeout",
        str(args.timeout),
        "-q",
        "-rN",
        f"--junitxml={junit}",
        *files,
    ]
    if selection:
        cmd += ["-k", selection]
    started = time.monotonic()
    print(f"== {mode}: {' '.join(files)}{f' -k {selection!r}' if selection else ''}", flush=True)
    try:
        with (out / f"{tag}-{mode}-pytest.log").open("wb") as plog:
            subprocess.run(cmd, env=env, cwd=root, stdout=plog, stderr=subprocess.STDOUT)
    finally:
        stop_worker(proc, handle)
    seconds = time.monotonic() - started
    outcomes = parse_junit(junit)
    counts = {
        k: sum(1 for v in outcomes.values() if v == k) for k in sorted(set(outcomes.values()))
    }
    print(f"   {mode}: {counts} in {seconds:.0f} s", flush=True)
    checks = worker_checks(log)
    wrong = as_a_user_runs(mode, checks, args.fast_path)
    if wrong and outcomes:
        raise SystemExit(f"the {mode} run is no result: {wrong}; see {log}")
    if checks and mode != "plain":
        print(f"   {mode} worker processes: {sorted(set(checks))}", flush=True)
    return Run(mode, outcomes, seconds, checks)


def differences(plain: Run, other: Run) -> dict[str, tuple[str, str]]:
    return {
        name: (plain.outcomes.get(name, "absent"), outcome)
        for name, outcome in other.outcomes.items()
        if outcome != plain.outcomes.get(name, "absent")
    } | {
        name: (outcome, "absent")
        for name, outcome in plain.outcomes.items()
        if name not in other.outcomes
    }


def code_version() -> str:
    """The commit the pooled runs ran (``+changes`` when the work tree differs from it)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return f"{head or 'unknown'}{'+changes' if dirty else ''}"


def selection_of(names: list[str]) -> str:
    return " or ".join(sorted({n.split("::")[-1].split("[")[0] for n in names}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suites", default="canvas,tasks")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--subset", action="store_true", help="the bounded subset of make test")
    parser.add_argument("-k", dest="selection", default=None)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--timeout", type=int, default=120, help="seconds per test")
    parser.add_argument("--no-confirm", action="store_true")
    parser.add_argument(
        "--tag", default=None, help="name of this run's logs and report (default: subset or full)"
    )
    parser.add_argument(
        "--fast-path",
        choices=("on", "off"),
        default="on",
        help="POOLS['SQL_FAST_PATH'] of the pooled runs (on: what a user gets by default)",
    )
    parser.add_argument(
        "--reuse-plain", action="store_true", help="take the plain outcomes of the last run"
    )
    parser.add_argument(
        "--plain-from",
        default=None,
        metavar="TAG",
        help="take the plain outcomes of the run tagged TAG, read once the pooled modes are "
        "done (that run may still be going, on another Redis: POOLS_PEER_BROKER/BACKEND)",
    )
    args = parser.parse_args(argv)
    suites = args.suites.split(",")
    modes = args.modes.split(",")
    if "plain" not in modes:
        modes.insert(0, "plain")
    selection = args.selection
    if args.subset and not selection:
        selection = " or ".join(name for s in suites for name in SUBSET[s])
    files = [SUITES[s] for s in suites]

    version = celery_version()
    code = code_version()  # before the runs: the work tree may change while they go
    root = fetch_suite(version)
    patch_conftest(root)
    tasks_file = CACHE / "tasks.json"
    names = list_tasks(root, tasks_file)
    print(f"Celery {version}: {', '.join(files)}; {len(names)} tasks pooled in pooled modes")
    tag = args.tag or ("subset" if args.subset else "full")
    runs: dict[str, Run] = {}
    for mode in modes:
        if mode == "plain" and args.plain_from:
            continue
        saved = CACHE / "runs" / f"{tag}-{mode}.xml"
        if mode == "plain" and args.reuse_plain and saved.exists():
            runs[mode] = Run(mode, parse_junit(saved), 0.0)
            print(f"== plain: reusing {saved}")
            continue
        runs[mode] = run_mode(root, mode, files, selection, args, tasks_file, tag)

    if args.plain_from:
        saved = CACHE / "runs" / f"{args.plain_from}-plain.xml"
        deadline = time.monotonic() + 3600
        while not saved.exists() and time.monotonic() < deadline:
            time.sleep(10)
        runs = {"plain": Run("plain", parse_junit(saved), 0.0), **runs}
        print(f"== plain: the outcomes of {saved}")
    plain = runs["plain"]
    failing_plain = sorted(n for n, o in plain.outcomes.items() if o == "failed")
    differences_by_mode: dict[str, dict[str, tuple[str, str]]] = {}
    unconfirmed_by_mode: dict[str, dict[str, tuple[str, str]]] = {}
    report: dict[str, object] = {
        "celery": version,
        "code": code,
        "fast_path": args.fast_path,
        "suites": files,
        "selection": selection,
        "runs": {
            m: {
                "seconds": round(r.seconds),
                "outcomes": r.outcomes,
                "workers": sorted(set(r.checks)),
            }
            for m, r in runs.items()
        },
        "differences": differences_by_mode,
        "unconfirmed": unconfirmed_by_mode,
    }
    status = 0
    for mode, run in runs.items():
        if mode == "plain":
            continue
        diff = differences(plain, run)
        if diff and not args.no_confirm:
            # Run the differing tests again, alone, in both modes: keep what holds.
            again = selection_of(list(diff))
            print(f"   re-running {len(diff)} differing test(s) of {mode} in both modes")
            plain2 = run_mode(root, "plain", files, again, args, tasks_file, f"{tag}-confirm")
            mode2 = run_mode(root, mode, files, again, args, tasks_file, f"{tag}-confirm")
            held = {
                n: d
                for n, d in diff.items()
                if n in mode2.outcomes and plain2.outcomes.get(n) != mode2.outcomes.get(n)
            }
            unconfirmed_by_mode[mode] = {n: d for n, d in diff.items() if n not in held}
            for name, (p, o) in sorted(unconfirmed_by_mode[mode].items()):
                print(f"   not held when re-run alone: {name}: plain {p}, {mode} {o}")
            diff = held
        differences_by_mode[mode] = diff
        print(f"\n{mode} vs plain: {len(diff)} difference(s)")
        for name, (p, o) in sorted(diff.items()):
            print(f"   {name}: plain {p}, {mode} {o}")
            if o != "passed" and not (p == "failed"):
                status = 1
    print(f"\nFailing on plain Celery with an external worker ({len(failing_plain)}), excluded:")
    for name in failing_plain:
        print(f"   {name}")
    (CACHE / f"report-{tag}.json").write_text(json.dumps(report, indent=1, sort_keys=True))
    print(f"\nreport: {CACHE / f'report-{tag}.json'}; logs: {CACHE / 'runs'}")
    compared = sum(len(r.outcomes) for m, r in runs.items() if m != "plain")
    worse = sum(
        1
        for diff in differences_by_mode.values()
        for plain_outcome, pooled in diff.values()
        if pooled != "passed" and plain_outcome != "failed"
    )
    # One closing line: a test compared in one pooled mode passes unless pooling made it
    # worse than on plain Celery (a test that fails plain and passes pooled is no failure).
    unconfirmed = sum(len(d) for d in unconfirmed_by_mode.values())
    print(
        f"peer: {compared - worse} passed, {worse} failed"
        f"{f' ({unconfirmed} difference(s) did not hold when re-run alone)' if unconfirmed else ''}"
        f"; code {report['code']}, fast path {args.fast_path}"
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
