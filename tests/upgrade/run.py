"""A rolling upgrade from the previous release to this tree, with calls in flight.

    python -m tests.upgrade.run                  # from PREVIOUS (below)
    python -m tests.upgrade.run --from <git ref> --calls 100
    python -m tests.upgrade.run --database mysql # MariaDB/MySQL (the ORM path)

What a rolling deploy does, on real PostgreSQL (or MariaDB/MySQL: 127.0.0.1:3306, root,
``POOLS_MYSQL_*`` as in ``tests/settings.py``), Redis and prefork workers:

1. The previous release's tree (``git archive``) and a fresh database ``pools_upgrade``
   (MariaDB: ``mdb_upgrade``) migrated by that release.
2. That release's worker (``-c 4``) and its web process submitting pooled calls at a steady
   pace (``tests/upgrade/submit.py``, run with that tree first on ``PYTHONPATH``).
3. While they run: the migrations this tree would apply (``migrate --plan``; none when
   the previous release's migrations are all replaced by this tree's), this tree's
   ``check --database default`` (it must name ``migrate`` when there are some), then this
   tree's ``migrate`` (timed); afterwards ``showmigrations`` must list nothing unapplied.
4. This tree's worker with beat embedded; then the old worker gets SIGTERM (warm shutdown,
   what a deploy sends) and exits.
5. This tree's web process submits calls too; both web processes finish.
6. Every call must reach a final result.

Figures: calls refused at submit, calls that ended FAILURE, calls still PENDING, bodies
run more than once (counted in both workers' logs), the longest gap between two body
starts (calls were waiting all along), and how long ``migrate`` took. The targets: 0, 0,
0, 0, and a gap shorter than the lease. Exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from celery import Celery

from pools.celery import processes

ROOT = Path(__file__).resolve().parents[2]
#: The previous release: 0.1.0, the commit tagged v0.1.0 ("Release 0.1.0"), named by its
#: hash so that a clone without tags runs the same test.
PREVIOUS = "c82ec861509c224872739d69e4e8177ff90bff26"
#: The last commit before the migrations were squashed into the 0.1.0 initial migration
#: (its 18 migrations and stored functions version 7): the schema tests compare a database
#: that went through that chain with one migrated by this tree.
PRE_SQUASH = "bf7d954c7e295b5c1b3b67942b622799398dc9a8"
#: The pools migrations after the squashed initial one (0.1.0): this tree's ``migrate``
#: applies them, and only them, to a database the old chain built.
LATER = ["0002_debounce_key"]


def planned_pools_migrations(plan: str) -> list[str]:
    """The pools migrations a ``migrate --plan`` output lists."""
    import re

    return [m for app, m in re.findall(r"^(\w+)\.(\w+)$", plan, flags=re.M) if app == "pools"]
DATABASE = "pools_upgrade"
#: The database of a run on MariaDB/MySQL (``--database mysql``).
MYSQL_DATABASE = "mdb_upgrade"
BROKER = os.environ.get("POOLS_UPGRADE_BROKER", "redis://127.0.0.1:6379/10")
BACKEND = os.environ.get("POOLS_UPGRADE_BACKEND", "redis://127.0.0.1:6379/11")
#: Short, so that a claim lost in the upgrade would show as a gap of about this much.
LEASE_SECONDS = 10.0
SWEEP_SECONDS = 5.0
#: Each call's body sleeps this long in a 2-slot pool ("warehouse" of tests/settings.py, 50
#: waiting at most): 8 calls/s, a little more than the web processes send.
BODY_SECONDS = 0.25
INTERVAL = 0.15
FINAL = {"SUCCESS", "FAILURE", "REVOKED"}
RAN = re.compile(r"Task tests\.testapp\.tasks\.record\[([0-9a-f-]+)\] (succeeded|raised)")


class UpgradeError(RuntimeError):
    """The upgrade could not be set up (no such commit, a command failed)."""


@dataclass
class Figures:
    """What the run measured (see the module docstring for the targets)."""

    previous: str
    database: str = "postgres"
    calls: int = 0
    refused: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)
    ran_twice: dict[str, int] = field(default_factory=dict)
    never_ran: list[str] = field(default_factory=list)
    longest_gap_seconds: float = 0.0
    migrate_seconds: float = 0.0
    #: Migrations this tree's ``migrate`` applied (``migrate --plan`` before it).
    planned: list[str] = field(default_factory=list)
    check_before_migrate: str = ""
    #: ``showmigrations`` lines still unapplied after ``migrate`` (every app).
    unapplied_after: list[str] = field(default_factory=list)
    old_worker_exit: int | None = None

    def missed(self) -> list[str]:
        """The targets this run missed (empty: all met)."""
        misses = []
        for name in ("refused", "failed", "pending", "ran_twice", "never_ran", "unapplied_after"):
            value = getattr(self, name)
            if value:
                shown = list(value.items() if isinstance(value, dict) else value)
                misses.append(f"{name}: {len(value)}, e.g. {shown[:2]}")
        if self.longest_gap_seconds >= LEASE_SECONDS:
            misses.append(f"a stall of {self.longest_gap_seconds:.1f} s (lease {LEASE_SECONDS} s)")
        if self.planned and "manage.py migrate" not in self.check_before_migrate:
            misses.append("check --database default did not name migrate before migrating")
        return misses


def in_history(ref: str) -> bool:
    """True when ``ref`` names a commit of this checkout's history."""
    found = subprocess.run(
        ["git", "cat-file", "-e", f"{ref}^{{commit}}"], cwd=ROOT, check=False, capture_output=True
    )
    return found.returncode == 0


def export_tree(ref: str, into: Path) -> str:
    """``git archive`` of ``ref`` into ``into``; returns the full commit id."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--verify", f"{ref}^{{commit}}"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        raise UpgradeError(
            f"commit {ref} is not in this checkout's history (a shallow clone?): "
            "git fetch --unshallow, or pass --from"
        ) from exc
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return commit


def mysql_server() -> Any:
    """A connection to the MariaDB/MySQL server (no database), as ``tests/settings.py``
    finds it."""
    import MySQLdb

    return MySQLdb.connect(
        host=os.environ.get("POOLS_MYSQL_HOST", "127.0.0.1"),
        port=int(os.environ.get("POOLS_MYSQL_PORT", "3306")),
        user=os.environ.get("POOLS_MYSQL_USER", "root"),
        password=os.environ.get("POOLS_MYSQL_PASSWORD", ""),
    )


def fresh_database(database: str = "postgres") -> None:
    if database == "mysql":
        conn = mysql_server()
        try:
            cursor = conn.cursor()
            cursor.execute(f"DROP DATABASE IF EXISTS {MYSQL_DATABASE}")
            cursor.execute(f"CREATE DATABASE {MYSQL_DATABASE} CHARACTER SET utf8mb4")
        finally:
            conn.close()
        return
    import psycopg

    with psycopg.connect(
        host="127.0.0.1", port=os.environ.get("POOLS_PG_PORT", "5432"), user="postgres",
        dbname="postgres", autocommit=True,
    ) as conn:  # fmt: skip
        conn.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {DATABASE}")


def env_for(tree: Path, **overrides: str) -> dict[str, str]:
    """The environment of every process of ``tree``'s release (``overrides`` last: another
    database for the schema tests)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    env.update(
        DJANGO_SETTINGS_MODULE="tests.settings",
        PYTHONPATH=str(tree),
        POOLS_TEST_DB="postgres",
        POOLS_PG_NAME=DATABASE,
        CELERY_BROKER_URL=BROKER,
        CELERY_RESULT_BACKEND=BACKEND,
        POOLS_LEASE_SECONDS=str(LEASE_SECONDS),
        POOLS_SWEEP_SECONDS=str(SWEEP_SECONDS),
    )
    env.update(overrides)
    return env


def on_database(database: str) -> dict[str, str]:
    """:func:`env_for` overrides of a run on ``database`` (``postgres``: none)."""
    if database == "mysql":
        return {"POOLS_TEST_DB": "mysql", "POOLS_MYSQL_NAME": MYSQL_DATABASE}
    return {}


def manage(tree: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """``django-admin <args>`` with ``tree``'s code (in ``env``, default
    :func:`env_for`); its output (raises on failure but for ``check``)."""
    done = subprocess.run(
        [sys.executable, "-m", "django", *args],
        cwd=tree,
        env=env or env_for(tree),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0 and args[0] != "check":
        raise UpgradeError(f"{' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout + done.stderr


def web(
    tree: Path, out: Path, count: int, tag: str, logs: Path, env: dict[str, str]
) -> processes.Process:
    argv = [
        sys.executable,
        str(ROOT / "tests" / "upgrade" / "submit.py"),
        str(out),
        str(count),
        str(INTERVAL),
        str(BODY_SECONDS),
        tag,
    ]
    return processes.start_process(
        argv, log=logs / f"web-{tag}.log", name=f"web-{tag}", env=env, cwd=tree
    )


def worker(
    tree: Path, node: str, logs: Path, *, beat: bool, env: dict[str, str]
) -> processes.Process:
    return processes.start_worker(
        "tests",
        node=node,
        log=logs / f"{node}.log",
        concurrency=4,
        beat=beat,
        env=env,
        cwd=tree,
    )


def _ready(process: processes.Process, app: Celery) -> None:
    try:
        processes.wait_ready([process], timeout=120, ping=app)
    except processes.ProcessStartError as exc:
        raise UpgradeError(f"{exc}\n{process.log_text()[-4000:]}") from exc


def _flush() -> None:
    import redis

    for url in (BROKER, BACKEND):
        client = redis.Redis.from_url(url)
        client.flushdb()
        client.close()


def run(
    previous: str = PREVIOUS,
    calls: int = 100,
    workdir: Path | None = None,
    new: Path = ROOT,
    database: str = "postgres",
) -> Figures:
    """The whole upgrade to the tree ``new`` (this checkout) on ``database`` (``postgres``
    or ``mysql``); returns its figures (processes are stopped in any case)."""
    workdir = workdir or Path(tempfile.mkdtemp(prefix="pools-upgrade-"))
    old = workdir / "previous"
    logs = workdir / "logs"
    figures = Figures(previous=export_tree(previous, old), database=database)
    old_env, new_env = (env_for(tree, **on_database(database)) for tree in (old, new))
    fresh_database(database)
    _flush()
    # Celery reads these variables before its own configuration (a test run sets them).
    os.environ.update(CELERY_BROKER_URL=BROKER, CELERY_RESULT_BACKEND=BACKEND)
    app = Celery("upgrade", broker=BROKER, backend=BACKEND)
    manage(old, "migrate", "--noinput", env=old_env)
    started: list[processes.Process] = []
    out = workdir / "calls.jsonl"
    try:
        old_worker = worker(old, "old", logs, beat=False, env=old_env)
        started.append(old_worker)
        _ready(old_worker, app)
        old_web = web(old, out, calls, "old", logs, old_env)
        started.append(old_web)
        time.sleep(2.0)  # calls in flight on the old release
        plan = manage(new, "migrate", "--plan", env=new_env)
        figures.planned = re.findall(r"^(\w+\.\w+)$", plan, flags=re.M)
        figures.check_before_migrate = manage(new, "check", "--database", "default", env=new_env)
        began = time.monotonic()
        manage(new, "migrate", "--noinput", env=new_env)
        figures.migrate_seconds = round(time.monotonic() - began, 2)
        shown = manage(new, "showmigrations", env=new_env)
        figures.unapplied_after = [line.strip() for line in shown.splitlines() if "[ ]" in line]
        new_worker = worker(new, "new", logs, beat=True, env=new_env)
        started.append(new_worker)
        _ready(new_worker, app)
        old_worker.proc.terminate()  # a deploy's SIGTERM: warm shutdown
        try:
            figures.old_worker_exit = old_worker.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            figures.old_worker_exit = None
        new_web = web(new, out, calls // 2, "new", logs, new_env)
        started.append(new_web)
        for process in (old_web, new_web):
            process.proc.wait(timeout=120 + calls * INTERVAL)
        _settle(figures, out, app, (old_worker, new_worker))
    finally:
        processes.stop(started, 20.0)
    return figures


def _settle(
    figures: Figures, out: Path, app: Celery, workers: tuple[processes.Process, ...]
) -> None:
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    figures.calls = len(lines)
    figures.refused = [f"{x['tag']} {x['i']}: {x['error']}" for x in lines if "error" in x]
    ids = [x["id"] for x in lines if "id" in x]
    deadline = time.monotonic() + 180
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        states = {i: app.AsyncResult(i).state for i in ids}
        if all(s in FINAL for s in states.values()):
            break
        time.sleep(1.0)
    figures.pending = [i for i, s in states.items() if s not in FINAL]
    figures.failed = [i for i, s in states.items() if s in {"FAILURE", "REVOKED"}]
    runs: Counter[str] = Counter()
    for process in workers:
        runs.update(m.group(1) for m in RAN.finditer(process.log_text()))
    figures.ran_twice = {i: n for i, n in runs.items() if n > 1}
    figures.never_ran = [i for i in ids if runs[i] == 0 and i not in figures.pending]
    starts = sorted(
        float(result["start"])
        for i in ids
        if states.get(i) == "SUCCESS"
        and isinstance(result := app.AsyncResult(i).result, dict)
        and "start" in result
    )
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    figures.longest_gap_seconds = round(max(gaps, default=0.0), 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="previous", default=PREVIOUS, help="git ref of the release")
    parser.add_argument("--calls", type=int, default=100, help="calls of the old web process")
    parser.add_argument("--database", choices=["postgres", "mysql"], default="postgres")
    args = parser.parse_args(argv)
    figures = run(args.previous, args.calls, database=args.database)
    report: dict[str, Any] = asdict(figures)
    report["missed"] = figures.missed()
    print(json.dumps(report, indent=2))
    return 1 if report["missed"] else 0


if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    raise SystemExit(main())
