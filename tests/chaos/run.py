"""The chaos scenario: pooled tasks through three pools while faults are injected.

``python -m tests.chaos.run [--seed N] [--tasks N] [--faults N] [--kinds k1,k2]``

Real PostgreSQL and Redis servers of its own (a cluster ``chaos`` on port 5433, created on
first use with ``pg_createcluster``, and a ``redis-server`` on port 6380), so that restarting
them disturbs nothing else on the machine; real ``celery worker`` prefork processes and a
real ``celery beat`` (DatabaseScheduler) firing the sweep. The
client submits ``--tasks`` calls of five pooled task types (single-pool, multi-pool, a
retrying one, and one whose arguments are dates, datetimes, UUIDs, Decimals and bytes) while
``--faults`` faults hit at random times, of these kinds:

* ``sigkill``: a worker's whole process group is SIGKILLed, and a new worker started;
* ``sigstop``: a worker child running a body is paused past its lease, then resumed;
* ``pg_restart``: ``pg_ctlcluster ... restart``;
* ``redis_restart``: the broker is shut down without saving (queued messages are lost)
  and started again;
* ``cancel_burst``: up to 20 random calls are cancelled at once;
* ``db_partition``: a worker's PostgreSQL traffic is black-holed (no RST, no FIN: a dead
  switch) for :data:`PARTITION_SECONDS`, then heals;
* ``broker_partition``: the same with its broker traffic.

The partition kinds put every worker behind two loopback proxies of its own
(:class:`tests.support.blackhole.BlackholeProxy`), one to PostgreSQL, one to the broker;
they are not in the default ``--kinds`` (opt in: ``--kinds db_partition,broker_partition``).
Then it waits for every entry to end, reads the bodies' own records
(:mod:`tests.chaos.tasks`) and checks (:mod:`tests.chaos.check`): no pool ever had more
bodies alive (start to last sign of life) than its capacity, no claim ran twice at once,
every entry ended, every ``AsyncResult`` is final, every typed-argument call returned
exactly the values it was sent (types included), and no due head of a line waited over
100 ms while its slots were free (a lost wake-up; by the database's record, outside the
windows when a server was down: :func:`tests.chaos.check.starved_heads`). Results go to a filesystem result
backend, which survives the broker restart. It prints one summary line and exits 1 on any
violation. ``--seed`` reproduces the plan (times, kinds, task mix); the machine's timing
still varies.

``--shared-servers`` runs on servers that others use as they are (``--pg-port``,
``--redis-port``, database ``--database``): the runner neither creates nor starts them, and
refuses the restart faults; only the process faults and cancel bursts hit.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pools.celery import processes
from pools.celery.processes import Process
from tests.chaos.check import Body, Stall
from tests.support.blackhole import BlackholeProxy
from tests.support.starvation import Episode

ROOT = Path(__file__).resolve().parents[2]
#: The faults of a default run.
DEFAULT_KINDS = ("sigkill", "sigstop", "pg_restart", "redis_restart", "cancel_burst")
#: Silent network partitions of one worker (opt-in: they put proxies in front of workers).
PARTITION_KINDS = ("db_partition", "broker_partition")
KINDS = (*DEFAULT_KINDS, *PARTITION_KINDS)
#: The faults that restart a server: never with ``--shared-servers``.
SERVER_KINDS = {"pg_restart", "redis_restart"}
#: One planned call: task name, positional and keyword arguments.
Call = tuple[str, list[Any], dict[str, Any]]
LEASE_SECONDS = 3.0
SWEEP_SECONDS = 1.0
#: How long a partition lasts before it heals: past two leases, so the claims it cut off
#: are re-admitted elsewhere while it lasts.
PARTITION_SECONDS = 2 * LEASE_SECONDS + 2.0
#: The scenario's own servers, so that restarting them disturbs nothing else on the machine.
PG_CLUSTER = "chaos"


def redis_start(port: int) -> list[str]:
    return [
        "redis-server", "--daemonize", "yes", "--bind", "127.0.0.1", "--port", str(port),
        "--save", "", "--appendonly", "no", "--dir", tempfile.gettempdir(),
        "--logfile", str(Path(tempfile.gettempdir()) / f"redis-chaos-{port}.log"),
    ]  # fmt: skip


def _pg_version() -> str:
    return sorted(os.listdir("/etc/postgresql"))[-1]


@dataclass
class Fault:
    kind: str
    at: float  # due when this fraction of the calls has finished
    started: float = 0.0
    ended: float = 0.0
    detail: str = ""


@dataclass
class Run:
    args: argparse.Namespace
    workdir: Path
    rng: random.Random
    workers: list[Process] = field(default_factory=list)
    beat: Process | None = None
    keys: list[str] = field(default_factory=list)
    #: When each call was sent (``time.time()``, the bodies' clock).
    submitted_at: dict[str, float] = field(default_factory=dict)
    cancelled: set[str] = field(default_factory=set)
    #: Typed-argument calls: key -> the result they must return.
    typed: dict[str, Any] = field(default_factory=dict)
    submit_retries: int = 0
    #: Workers (and beats) that exited by themselves and were started again, as a process
    #: supervisor (systemd, Kubernetes) would; see :func:`supervise`.
    restarted: Counter[str] = field(default_factory=Counter)
    generation: int = 0
    faults: list[Fault] = field(default_factory=list)
    #: Per worker (partition kinds): its PostgreSQL and broker proxies.
    proxies: dict[str, tuple[BlackholeProxy, BlackholeProxy]] = field(default_factory=dict)
    #: (monotonic time, proxy) of the partitions to heal.
    heal_at: list[tuple[float, BlackholeProxy]] = field(default_factory=list)
    #: pid -> [stopped, resumed] wall times of its SIGSTOPs (resumed 0 while paused).
    pauses: dict[int, list[list[float]]] = field(default_factory=dict)


# ----------------------------------------------------------------------------- set-up


def configure(workdir: Path, args: argparse.Namespace) -> None:
    """Environment read by tests/settings.py here and in every worker and beat."""
    (workdir / "bodies").mkdir(parents=True)
    (workdir / "results").mkdir()
    os.environ.update(
        {
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "POOLS_TEST_DB": "postgres",
            "POOLS_PG_NAME": args.database,
            "POOLS_PG_PORT": str(args.pg_port),
            "CELERY_BROKER_URL": args.broker,
            "CELERY_RESULT_BACKEND": f"file://{workdir / 'results'}",
            "POOLS_LEASE_SECONDS": str(LEASE_SECONDS),
            "POOLS_SWEEP_SECONDS": str(SWEEP_SECONDS),
            "CHAOS_DIR": str(workdir / "bodies"),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
        }
    )
    os.environ.pop("POOLS_HEARTBEAT_SECONDS", None)
    sys.path.insert(0, str(ROOT))


def ensure_services(args: argparse.Namespace) -> None:
    """The scenario's PostgreSQL cluster and Redis server up (created on first use)."""
    if args.shared_servers:
        _wait(lambda: _pg_up(args.pg_port), 60, f"PostgreSQL on port {args.pg_port}")
        _wait(lambda: _redis_up(args.redis_port), 20, f"Redis on port {args.redis_port}")
        return
    version = _pg_version()
    listed = subprocess.run(["pg_lsclusters", "-h"], capture_output=True, text=True).stdout
    if not any(line.split()[:2] == [version, PG_CLUSTER] for line in listed.splitlines()):
        subprocess.run(
            ["pg_createcluster", version, PG_CLUSTER, "-p", str(args.pg_port), "--",
             "--auth=trust"],
            check=True,
            capture_output=True,
        )  # fmt: skip
    subprocess.run(_pg_ctl("start"), capture_output=True)  # "already running" is fine
    _wait(lambda: _pg_up(args.pg_port), 60, "PostgreSQL (chaos cluster) to accept connections")
    if not _redis_up(args.redis_port):
        subprocess.run(redis_start(args.redis_port), check=True, capture_output=True)
        _wait(lambda: _redis_up(args.redis_port), 20, "Redis (chaos) to start")


def _pg_ctl(action: str) -> list[str]:
    return ["pg_ctlcluster", "--skip-systemctl-redirect", _pg_version(), PG_CLUSTER, action]


def _pg_up(port: int) -> bool:
    import psycopg

    try:
        with psycopg.connect(f"host=127.0.0.1 port={port} user=postgres dbname=postgres"):
            return True
    except psycopg.Error:
        return False


def _redis_up(port: int) -> bool:
    import redis

    try:
        return bool(redis.Redis(host="127.0.0.1", port=port, socket_timeout=1).ping())
    except redis.RedisError:
        return False


def fresh_database(name: str, port: int) -> None:
    import psycopg

    dsn = f"host=127.0.0.1 port={port} user=postgres dbname=postgres"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


def setup_django(args: argparse.Namespace) -> None:
    import django
    import redis

    fresh_database(args.database, args.pg_port)
    redis.Redis.from_url(args.broker).flushdb()
    django.setup()
    from django.core.management import call_command

    from pools.core import pool_crud
    from tests.chaos.tasks import POOLS

    call_command("migrate", verbosity=0)
    for name, slots in POOLS.items():
        pool_crud.create_pool(name=name, slots=slots)


def _wait(predicate: Any, timeout: float, what: str, step: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")


def start_worker(run: Run) -> Process:
    from celery import current_app

    run.generation += 1
    env = None
    if run.args.partitions:
        from urllib.parse import urlsplit, urlunsplit

        broker = urlsplit(run.args.broker)
        db = BlackholeProxy("127.0.0.1", run.args.pg_port)
        mq = BlackholeProxy(broker.hostname or "127.0.0.1", broker.port or 6379)
        env = {
            **os.environ,
            "POOLS_PG_PORT": str(db.port),
            "CELERY_BROKER_URL": urlunsplit(
                broker._replace(netloc=broker.netloc.rpartition("@")[0] + f"@127.0.0.1:{mq.port}")
                if "@" in broker.netloc
                else broker._replace(netloc=f"127.0.0.1:{mq.port}")
            ),
        }
    worker = processes.start_worker(
        "tests",
        node=f"chaos{run.generation}",
        log=run.workdir / f"worker-{run.generation}.log",
        concurrency=run.args.concurrency,
        include=["tests.chaos.tasks"],
        extra_args=["-O", "fair"],
        env=env,
        cwd=ROOT,
    )
    if env is not None:
        run.proxies[worker.name] = (db, mq)

    def ready() -> bool:
        if not worker.alive():
            raise RuntimeError(f"worker {worker.name} exited; see {worker.log}")
        try:
            replies = current_app.control.ping(destination=[worker.name], timeout=0.5) or []
        except Exception:  # the broker restarting: not ready yet
            return False
        return any(worker.name in reply for reply in replies)

    _wait(ready, 90, f"worker {worker.name} to answer a ping", step=0.5)
    run.workers.append(worker)
    return worker


def start_beat(run: Run) -> Process:
    return processes.start_celery(
        "tests",
        ["beat", "-S", "django_celery_beat.schedulers:DatabaseScheduler", "--max-interval", "1",
         "-l", "info", "-s", str(run.workdir / "beat-schedule")],
        log=run.workdir / f"beat-{run.restarted['beat']}.log",
        name="beat",
        cwd=ROOT,
    )  # fmt: skip


def supervise(run: Run) -> None:
    """Start again what exited by itself, as systemd's ``Restart=always`` would.

    Celery 5.7 / kombu 5.7 workers on Redis can die when the broker restarts
    ("Unrecoverable error: AttributeError ... 'hostname'" while restoring unacked messages
    on a dead connection): that is the broker client's behaviour, not the pools', and
    production runs workers under a supervisor. The summary reports how often it happened.
    """
    for worker in [w for w in run.workers if not w.alive()]:
        run.workers.remove(worker)
        for proxy in run.proxies.pop(worker.name, ()):
            proxy.close()
        run.restarted["worker"] += 1
        start_worker(run)
    if run.beat is not None and not run.beat.alive():
        run.restarted["beat"] += 1
        run.beat = start_beat(run)


# ----------------------------------------------------------------------------- load


def plan_tasks(run: Run) -> list[Call]:
    """(task name, args, kwargs) for each call, from the seed; ``args[0]`` is the body's
    milliseconds."""
    from tests.chaos.tasks import typed_arguments

    mix = [("chaos.single_a", 40), ("chaos.single_b", 25), ("chaos.multi_ac", 15),
           ("chaos.retrying_c", 20), ("chaos.typed_b", run.args.typed_weight)]  # fmt: skip
    names = [n for n, w in mix if w > 0]
    weights = [w for _, w in mix if w > 0]
    out: list[Call] = []
    for _ in range(run.args.tasks):
        name = run.rng.choices(names, weights)[0]
        long = run.rng.random() < 0.15  # long bodies give the pauses something to pause
        millis = run.rng.randint(400, 1500) if long else run.rng.randint(10, 60)
        if run.args.partitions and run.rng.random() < 0.05:
            # Bodies longer than a lease: a partition can only cut those off in time.
            millis = run.rng.randint(int(LEASE_SECONDS * 1500), int(LEASE_SECONDS * 3000))
        if name == "chaos.typed_b":
            values, kwargs = typed_arguments(run.rng)
            out.append((name, [millis, values], kwargs))
        else:
            out.append((name, [millis], {}))
    return out


def plan_faults(run: Run) -> list[Fault]:
    """Faults of the chosen kinds in turn, each due at a random point of the work.

    ``at`` is a fraction of the calls finished (results stored), between 5 % and 85 %, so
    faults fall while work is in flight however fast the machine is.
    """
    kinds = [k for k in run.args.kinds.split(",") if k]
    chosen = [kinds[i % len(kinds)] for i in range(run.args.faults)]
    run.rng.shuffle(chosen)
    points = sorted(run.rng.uniform(0.05, 0.85) for _ in chosen)
    return [Fault(kind, at) for kind, at in zip(chosen, points, strict=True)]


def finished_fraction(run: Run) -> float:
    """Share of the planned calls whose result is stored (one file each)."""
    return len(os.listdir(run.workdir / "results")) / max(int(run.args.tasks), 1)


def submit(
    run: Run,
    name: str,
    args: list[Any],
    kwargs: dict[str, Any],
    tick: Callable[[], None] = lambda: None,
) -> None:
    """Send one call; while pool state is unavailable, retry for up to 2 minutes, running
    ``tick`` between tries (the runner's own duties, such as resuming paused workers)."""
    from celery import current_app

    from pools.exceptions import PoolUnavailable

    deadline = time.monotonic() + 120
    while True:
        try:
            sent = time.time()
            result = current_app.send_task(name, args=args, kwargs=kwargs)
            run.keys.append(result.id)
            run.submitted_at[result.id] = sent
            if name == "chaos.typed_b":
                from tests.chaos.tasks import typed_result

                run.typed[result.id] = typed_result(args[1], kwargs)
            return
        except PoolUnavailable:  # PostgreSQL restarting: the caller retries
            run.submit_retries += 1
            if time.monotonic() > deadline:
                raise
            tick()
            time.sleep(0.2)


# ----------------------------------------------------------------------------- faults


def _open_bodies(run: Run) -> dict[int, float]:
    """pid -> start time of bodies that have started and not ended (per the records)."""
    from tests.chaos.check import read_bodies

    return {b.pid: b.start for b in read_bodies(run.workdir / "bodies") if b.end is None}


def _open_long_bodies(run: Run) -> set[int]:
    """Pids running a body meant to last longer than a lease, with a lease of it still ahead."""
    from tests.chaos.check import read_bodies

    now = time.time()
    return {
        b.pid
        for b in read_bodies(run.workdir / "bodies")
        if b.end is None
        and (b.millis or 0) / 1000 > LEASE_SECONDS
        and b.start + (b.millis or 0) / 1000 - now > LEASE_SECONDS
    }


def _resume(pid: int, run: Run | None = None) -> None:
    """SIGCONT a paused process (gone already if its worker was SIGKILLed meanwhile)."""
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
    if run is not None:
        for window in run.pauses.get(pid, []):
            if not window[1]:
                window[1] = time.time()


def resumed_runs(run: Run, bodies: Sequence[Body]) -> list[float]:
    """Per body paused while it ran and resumed after its lease ended: seconds it ran after
    the SIGCONT until its last sign of life (its keeper stopping it)."""
    out = []
    for body in bodies:
        for stopped, resumed in run.pauses.get(body.pid, []):
            if resumed and body.start < stopped and body.end is not None and body.end > resumed:
                if resumed > body.valid_until:
                    out.append((body.last or body.end) - resumed)
    return out


def inject(run: Run, fault: Fault, resume_at: list[tuple[float, int]]) -> None:
    fault.started = time.time()
    live = [w for w in run.workers if w.alive()]
    if fault.kind == "sigkill" and live:
        victim = run.rng.choice(live)
        processes.kill([victim])
        run.workers.remove(victim)
        start_worker(run)
        fault.detail = victim.name
    elif fault.kind == "sigstop":
        children = {c for w in live for c in w.children()}
        paused = {pid for _, pid in resume_at}
        children -= paused
        busy = [pid for pid in _open_bodies(run) if pid in children]
        pool = busy or sorted(children)
        if pool:
            pid = run.rng.choice(sorted(pool))
            os.kill(pid, signal.SIGSTOP)
            run.pauses.setdefault(pid, []).append([time.time(), 0.0])
            resume_at.append((time.monotonic() + LEASE_SECONDS + 1.5, pid))
            fault.detail = f"pid {pid}{' (in a body)' if busy else ''}"
    elif fault.kind in PARTITION_KINDS:
        behind = [w for w in live if w.name in run.proxies]
        # Wait (up to 30 s) for a body longer than a lease to be under way, and cut its
        # worker off: only such a body can outlive its lease.
        working: list[Process] = []
        deadline = time.monotonic() + 30
        while not working and time.monotonic() < deadline:
            open_pids = _open_long_bodies(run)
            working = [w for w in behind if open_pids & set(w.children())]
            if not working:
                time.sleep(0.1)
        if behind:
            cut_off = run.rng.choice(working or behind)
            proxy = run.proxies[cut_off.name][0 if fault.kind == "db_partition" else 1]
            proxy.cut()
            run.heal_at.append((time.monotonic() + PARTITION_SECONDS, proxy))
            fault.detail = f"{cut_off.name}{' (running a long body)' if working else ''}"
    elif fault.kind == "pg_restart":
        subprocess.run(_pg_ctl("restart"), check=True, capture_output=True)
    elif fault.kind == "redis_restart":
        port = run.args.redis_port
        subprocess.run(
            ["redis-cli", "-h", "127.0.0.1", "-p", str(port), "shutdown", "nosave"],
            capture_output=True,
        )
        _wait(lambda: not _redis_up(port), 10, "Redis to stop")
        subprocess.run(redis_start(port), check=True, capture_output=True)
        _wait(lambda: _redis_up(port), 20, "Redis to start")
    elif fault.kind == "cancel_burst":
        from django.db import DatabaseError, connection

        import pools
        from pools.exceptions import PoolError
        from pools.models import QueueEntry
        from pools.states import EntryState

        def waiting_keys() -> list[str]:
            query = QueueEntry.objects.filter(state=EntryState.WAITING)
            return sorted(query.values_list("key", flat=True))

        try:
            waiting = waiting_keys()
        except DatabaseError:  # this process's connection died in a PostgreSQL restart
            connection.close()
            waiting = waiting_keys()
        picked = run.rng.sample(waiting, min(20, len(waiting)))
        for key in picked:
            try:
                pools.cancel(key)
                run.cancelled.add(key)
            except PoolError:
                pass  # already admitted, running or done: not cancellable
        fault.detail = f"{len(picked)} tried"
    fault.ended = time.time()


# ----------------------------------------------------------------------------- run


def drain(run: Run, timeout: float) -> dict[str, int]:
    """Wait until every entry has ended; returns what is left per state (empty: all ended)."""
    from django.db import connection
    from django.db.models import Count

    from pools.models import QueueEntry
    from pools.states import TERMINAL_STATES

    def left() -> dict[str, int]:
        try:
            rows = (
                QueueEntry.objects.exclude(state__in=TERMINAL_STATES)
                .values("state")
                .annotate(n=Count("pk"))
            )
            return {r["state"]: r["n"] for r in rows}
        except Exception:
            connection.close()
            return {"unknown": 1}

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        remaining = left()
        if not remaining:
            return {}
        supervise(run)
        time.sleep(0.5)
    return left()


#: A held entry whose lease lapsed longer ago than this is not coming back by itself: the
#: sweep (every SWEEP_SECONDS) should have put it back in line long before.
LAPSE_GRACE = 10 * SWEEP_SECONDS + LEASE_SECONDS


@dataclass
class Left:
    """Unfinished entries at the drain timeout, by whether the engine still has them."""

    #: In line: resumable, admission takes them when slots free up.
    waiting: list[str] = field(default_factory=list)
    #: Admitted or running under a lease that has not lapsed (or lapsed moments ago).
    held: list[str] = field(default_factory=list)
    #: Lost: held with a lease lapsed past LAPSE_GRACE, or in no state the engine resumes.
    lost: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.waiting or self.held or self.lost)


def classify_left() -> Left:
    """Sort the unfinished entries into still waiting, still held, and lost."""
    from django.db.models.functions import Now

    from pools.models import QueueEntry
    from pools.states import HELD_STATES, TERMINAL_STATES, EntryState

    out = Left()
    rows = (
        QueueEntry.objects.exclude(state__in=TERMINAL_STATES)
        .annotate(now=Now())
        .values_list("key", "state", "lease_expires_at", "now")
    )
    for key, state, lease, now in rows:
        if state == EntryState.WAITING:
            out.waiting.append(key)
        elif state in HELD_STATES and (
            lease is None or (now - lease).total_seconds() <= LAPSE_GRACE
        ):
            out.held.append(key)
        else:
            out.lost.append(key)
    return out


def typed_outcomes(run: Run) -> dict[str, tuple[str, Any]]:
    """(state, result) of every typed-argument call, from the result backend."""
    from celery import current_app

    out: dict[str, tuple[str, Any]] = {}
    for key in run.typed:
        result = current_app.AsyncResult(key)
        out[key] = (result.state, result.result)
    return out


def unfinished_results(run: Run, timeout: float) -> list[str]:
    from celery import current_app
    from celery.states import READY_STATES

    deadline = time.monotonic() + timeout
    pending = list(run.keys)
    while pending and time.monotonic() < deadline:
        pending = [k for k in pending if current_app.AsyncResult(k).state not in READY_STATES]
        if pending:
            time.sleep(0.5)
    return pending


def _seconds(value: float | None) -> str:
    return "(nothing waiting)" if value is None else f"after {value:.1f}s"


def recovery(
    fault: Fault, bodies: Sequence[Body], submitted_at: Mapping[str, float]
) -> float | None:
    """Seconds from the fault until the next body start after it ended, counting only work
    that was already waiting when it ended (a call sent before then whose body starts
    after it). None when nothing was waiting: an idle stretch is not a slow recovery."""
    waited = [
        b.start
        for b in bodies
        if b.start >= fault.ended and submitted_at.get(b.key, float("inf")) < fault.ended
    ]
    return min(waited) - fault.started if waited else None


#: Faults during which the runner knows a server was unreachable, and for how long after
#: the fault's own end (a partition heals :data:`PARTITION_SECONDS` after it was cut).
DOWN_FAULTS = {
    "pg_restart": 0.0,
    "redis_restart": 0.0,
    "db_partition": PARTITION_SECONDS,
    "broker_partition": PARTITION_SECONDS,
}


def down_windows(faults: Sequence[Fault]) -> list[tuple[float, float]]:
    """``(from, to)`` wall times when PostgreSQL (or the broker, which carries the timed
    wake-ups) was unreachable for the runner's own faults."""
    return [(f.started, f.ended + DOWN_FAULTS[f.kind]) for f in faults if f.kind in DOWN_FAULTS]


@dataclass
class WakeUps:
    """What the database's record says of wake-ups (:func:`lost_wake_ups`)."""

    #: Heads that waited over 100 ms with their slots free (multi-pool: 500 ms).
    starved: list[Episode]
    #: Every wait with free slots, however short (the margin the summary prints).
    waits: list[Episode]
    #: Entries whose re-admission is stamped before the requeue it followed.
    skewed: list[int]
    #: Starved heads whose follow-up pass a process fault took, run by the next sweep.
    lost_with_their_process: list[Episode]


def lost_wake_ups(run: Run, bodies: Sequence[Body]) -> WakeUps:
    """Heads that waited over 100 ms with their slots free, by the database's own record
    of every transition (:func:`tests.chaos.check.starved_heads`), less those whose
    follow-up pass a killed or stopped process took with it, which the sweep ran
    (:func:`tests.chaos.check.lost_with_their_process`); each such wait however short;
    and the entries whose re-admission is stamped before the requeue it followed
    (:func:`tests.chaos.check.stamp_skews`), from one read of that record."""
    from django.db import connection

    from pools.models import Pool, PoolEvent, QueueEntry
    from pools.states import EventKind
    from tests.chaos.check import lost_with_their_process, recorded, stamp_skews, starved_heads
    from tests.chaos.tasks import POOLS

    connection.close()  # a PostgreSQL restart may have broken this process's connection
    entries = list(QueueEntry.objects.all())
    stream, waiters = recorded(
        entries, PoolEvent.objects.filter(entry_id__isnull=False).order_by("id")
    )
    uncounted = {
        *Pool.objects.filter(paused=True).values_list("name", flat=True),
        *Pool.objects.exclude(rate="").values_list("name", flat=True),
        *PoolEvent.objects.filter(kind=EventKind.BACKOFF).values_list("pool", flat=True),
    }
    down = down_windows(run.faults)
    starved = starved_heads(stream, waiters, POOLS, down=down, uncounted_pools=uncounted)
    every = starved_heads(
        stream,
        waiters,
        POOLS,
        down=down,
        uncounted_pools=uncounted,
        threshold=0.0,
        multi_pool_threshold=0.0,
    )
    last_pid = {b.entry: b.pid for b in bodies}  # bodies are in order of start
    releasers = {e.queue_id: (e.worker, last_pid.get(e.queue_id, 0)) for e in entries}
    excused = lost_with_their_process(starved, stream, releasers, stalls(run.faults), SWEEP_SECONDS)
    return WakeUps([e for e in starved if e not in excused], every, stamp_skews(stream), excused)


def stalls(faults: Sequence[Fault]) -> list[Stall]:
    """The process faults that can stop a process between a commit and its follow-up."""
    out = []
    for fault in faults:
        if fault.kind == "sigkill" and fault.detail:
            out.append(Stall(fault.started, worker=fault.detail))
        elif fault.kind == "sigstop" and (pid := re.match(r"pid (\d+)", fault.detail)):
            out.append(Stall(fault.started, pid=int(pid.group(1))))
    return out


def _due(episode: Episode) -> str:
    """How the entry of ``episode`` came into line: sent (with its task), or due at a time."""
    from pools.models import QueueEntry

    entry = QueueEntry.objects.filter(queue_id=episode.entry).first()
    if entry is None:
        return ""
    due = f", due at t={entry.not_before.timestamp():.3f}" if entry.not_before is not None else ""
    return f" [{entry.task_name}{due}]"


def margin(waits: Sequence[Episode]) -> str:
    """The longest waits with free slots, of one-pool and of multi-pool heads (ms)."""
    one = max((e.seconds for e in waits if len(e.demand) == 1), default=0.0)
    several = max((e.seconds for e in waits if len(e.demand) > 1), default=0.0)
    return (
        f"longest wait with free slots {one * 1000:.0f} ms, several pools {several * 1000:.0f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.run", description=__doc__)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--kinds", default=",".join(DEFAULT_KINDS))
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--rate", type=float, default=60.0, help="calls submitted per second")
    parser.add_argument("--drain-timeout", type=float, default=300.0)
    parser.add_argument(
        "--strict-drain",
        action="store_true",
        help="fail when entries are still waiting or held at the drain timeout (CI)",
    )
    parser.add_argument("--database", default="pools_chaos")
    parser.add_argument(
        "--pg-port", type=int, default=5433, help="port of the scenario's own cluster 'chaos'"
    )
    parser.add_argument("--redis-port", type=int, default=6380, help="the scenario's own Redis")
    parser.add_argument("--redis-db", type=int, default=0, help="the broker's database number")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument(
        "--typed-weight",
        type=int,
        default=10,
        help="share of typed-argument calls (chaos.typed_b) in the mix; the others weigh 100",
    )
    parser.add_argument(
        "--shared-servers",
        action="store_true",
        help="use the servers on --pg-port/--redis-port as they are: never create, start or "
        "restart one (only with kinds that restart nothing)",
    )
    args = parser.parse_args(argv)
    unknown = set(args.kinds.split(",")) - set(KINDS)
    if unknown:
        parser.error(f"unknown fault kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
    if args.shared_servers and SERVER_KINDS & set(args.kinds.split(",")):
        parser.error(
            "--shared-servers: others use these servers, so no restart faults; choose "
            f"--kinds from {', '.join(k for k in KINDS if k not in SERVER_KINDS)}"
        )
    args.partitions = bool(set(args.kinds.split(",")) & set(PARTITION_KINDS))

    args.broker = f"redis://127.0.0.1:{args.redis_port}/{args.redis_db}"
    workdir = Path(tempfile.mkdtemp(prefix=f"chaos-{args.seed}-"))
    run = Run(args=args, workdir=workdir, rng=random.Random(args.seed))
    configure(workdir, args)
    ensure_services(args)
    setup_django(args)
    began = time.monotonic()
    resume_at: list[tuple[float, int]] = []
    try:
        for _ in range(args.workers):
            start_worker(run)
        run.beat = start_beat(run)
        calls = plan_tasks(run)
        run.faults = plan_faults(run)
        todo = list(run.faults)
        t0 = time.monotonic()
        i = 0
        stalled_since, last_done = time.monotonic(), -1.0

        def resume_due() -> None:
            now = time.monotonic()
            for item in [r for r in resume_at if r[0] <= now]:
                resume_at.remove(item)
                _resume(item[1], run)
            for heal in [h for h in run.heal_at if h[0] <= now]:
                run.heal_at.remove(heal)
                heal[1].heal()

        while i < len(calls) or todo:
            now = time.monotonic()
            resume_due()
            supervise(run)
            done = finished_fraction(run)
            if done != last_done:
                stalled_since, last_done = now, done
            if todo and (done >= todo[0].at or now - stalled_since > 60):
                # (a run stalled for a minute still gets its faults, then fails the checks)
                inject(run, todo.pop(0), resume_at)
                stalled_since = time.monotonic()
                continue
            if i < len(calls) and now >= t0 + i / args.rate:
                submit(run, *calls[i], tick=resume_due)
                i += 1
                continue
            time.sleep(0.02)
        for at, pid in sorted(resume_at):
            time.sleep(max(at - time.monotonic(), 0))
            _resume(pid, run)
        resume_at.clear()
        for at, proxy in sorted(run.heal_at, key=lambda h: h[0]):
            time.sleep(max(at - time.monotonic(), 0))
            proxy.heal()
        run.heal_at.clear()
        drain(run, args.drain_timeout)
        left = classify_left()
        unfinished = {*left.waiting, *left.held}
        pending = [k for k in unfinished_results(run, 60.0) if k not in unfinished]
        typed = typed_outcomes(run)
    finally:
        for _, pid in resume_at:
            _resume(pid, run)
        for _, proxy in run.heal_at:
            proxy.heal()
        processes.stop([*run.workers, *([run.beat] if run.beat else [])], timeout=15.0)
        for pair in run.proxies.values():
            for proxy in pair:
                proxy.close()
        ensure_services(args)

    from tests.chaos.check import (
        check,
        max_overlap,
        read_bodies,
        readmission_allowance,
        readmitted,
        typed_mismatches,
    )
    from tests.chaos.tasks import POOLS

    pauses = {pid: [(a, b or float("inf")) for a, b in w] for pid, w in run.pauses.items()}
    bodies = read_bodies(workdir / "bodies", pauses)
    resumed = resumed_runs(run, bodies)
    violations = check(bodies, POOLS)
    mismatched = typed_mismatches(run.typed, typed, skip=run.cancelled)
    # An admission whose message was never published shows as an entry admitted again
    # once its lease lapsed (the sweep rescues it, a lease later): with only process
    # faults, more of those than the faults explain is a violation.
    again = readmitted(bodies)
    again_total = sum(len(e) for e in again.values())
    allowance = readmission_allowance((f.kind for f in run.faults), args.concurrency)
    too_many = allowance is not None and again_total > allowance
    wake_ups = lost_wake_ups(run, bodies)
    starved, waits = wake_ups.starved, wake_ups.waits
    peaks = max_overlap(bodies)
    recoveries = [
        (r, f.kind) for f in run.faults if (r := recovery(f, bodies, run.submitted_at)) is not None
    ]
    slowest = max(recoveries, default=(0.0, "-"))
    kinds = Counter(f.kind for f in run.faults)
    overlap = ", ".join(f"{p} {peaks.get(p, (0, 0))[0]}/{c}" for p, c in POOLS.items())
    lost = len(left.lost)
    in_line = (
        f"; still in line at the drain timeout {len(left.waiting)} waiting, {len(left.held)} held"
        if left.waiting or left.held
        else ""
    )
    summary = (
        f"chaos: seed {args.seed}, {len(run.keys)} tasks ({len(bodies)} bodies, "
        f"{len(run.cancelled)} cancelled, {run.submit_retries} submit retries), "
        f"{len(run.faults)} faults ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))}); "
        f"max overlap {overlap}; lost entries {lost}{in_line}; "
        f"results not final {len(pending)}; typed calls {len(run.typed)}, "
        f"{len(mismatched)} not returning what was sent; re-admitted entries {again_total}"
        f"{f' (faults explain {allowance})' if allowance is not None else ''}"
        f"{' ' + str({t: len(e) for t, e in sorted(again.items())}) if again else ''}; "
        f"slowest recovery {slowest[0]:.1f}s ({slowest[1]}); "
        f"starved heads {len(starved)} ({margin(waits)}; re-admissions stamped before "
        f"their requeue {len(wake_ups.skewed)}; follow-ups lost with their process, run "
        f"by the sweep {len(wake_ups.lost_with_their_process)}); "
        f"restarted by the supervisor: {dict(run.restarted) or 'none'}; "
        + (
            f"resumed past the lease: {len(resumed)} bodies, stopped {max(resumed) * 1000:.0f} ms "
            "after SIGCONT at most; "
            if resumed
            else ""
        )
        + f"{time.monotonic() - began:.0f}s"
    )
    for line in violations.lines():
        print(f"VIOLATION: {line}")
    for line in mismatched[:10]:
        print(f"TYPED: {line}")
    if too_many:
        print(
            f"VIOLATION: {again_total} entries were admitted more than once, the faults "
            f"explain at most {allowance}: admissions whose message was never published "
            f"({', '.join(f'{t} {len(e)}' for t, e in sorted(again.items()))})"
        )
    for episode in starved[:10]:
        print(f"VIOLATION: lost wake-up: {episode} (from t={episode.start:.3f})")
    for episode in wake_ups.lost_with_their_process[:10]:
        print(f"  follow-up lost with its process: {episode} (from t={episode.start:.3f})")
    for episode in sorted(waits, key=lambda e: -e.seconds)[:5]:
        print(f"  longest waits: {episode} (from t={episode.start:.3f}){_due(episode)}")
    for fault in run.faults:
        print(
            f"  fault {fault.kind:<13} at {fault.at:4.0%} done, took {fault.ended - fault.started:4.1f}s,"
            f" recovered {_seconds(recovery(fault, bodies, run.submitted_at))} {fault.detail}"
        )
    if pending:
        print(f"results not final (first 5): {pending[:5]}")
    if left.lost:
        print(f"lost entries (first 5): {left.lost[:5]}")
    if args.keep:
        print(f"work directory: {workdir}")
    print(summary)
    # Entries still in line (or held under a live lease) when the drain timed out are not
    # lost: the engine would finish them. A CI run must finish them all (--strict-drain).
    failed = (
        bool(violations)
        or bool(mismatched)
        or too_many
        or bool(starved)
        or lost > 0
        or bool(pending)
        or (args.strict_drain and bool(left))
    )
    if not args.keep and not failed:
        shutil.rmtree(workdir, ignore_errors=True)
    elif failed:
        print(f"logs and records kept in {workdir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
