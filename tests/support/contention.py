"""Many OS processes submitting to and settling the same pools, with an independent recorder.

Used by ``tests/integration/core/test_contention.py`` (and reusable by a benchmark)::

    result = contention.run(entries=2000, processes=8, pools={"conc-a": 3, "conc-b": 3})
    assert result.max_held == {"conc-a": 3, ...}

Every child process is started with the ``spawn`` context and calls ``django.setup()``
with the settings module of the caller and the *same database* (its ``NAME`` is passed
down; nothing is hard-coded). ``POOLS["PUBLISHER"]`` is replaced in the children by
:data:`publisher`, so nothing touches Celery: an admission is only written to the recorder.

Each child both submits (random priorities, some entries naming two pools) and settles:
it picks admitted entries, claims one with :func:`pools.core.leases.start` (compare-and-set: one
process wins), records ``start``, sleeps a little, records ``end`` and calls
:func:`pools.core.admission.settle`.

The recorder is independent of the pools bookkeeping (never ``Demand`` rows): an
append-only log whose sequence gives one global order to every event:

* PostgreSQL: a plain table with a ``bigserial`` key in the test database (``nextval``
  is atomic and increases in real time across connections);
* MySQL/MariaDB: the same with an ``AUTO_INCREMENT`` key (the value is taken under
  InnoDB's auto-increment lock when the row is inserted, so it too increases in real time);
* SQLite: a separate SQLite file, one autocommit ``INSERT`` per event (the write lock
  serializes them, so rowids increase in real time).

``start`` is written after ``leases.start`` returned, ``end`` before ``settle`` is called,
so each recorded interval lies inside the real holding interval: if the recorded
intervals ever overlap beyond capacity, the real ones did too. :func:`sweep` walks the
ordered events and returns the maximum slots held at once per pool. A second sweep over
``time.monotonic_ns()`` (one system-wide clock for all processes) cross-checks it.

Lost wake-ups: each ``submit`` (written once enqueue returned) carries the entry's priority
and the clock before the enqueue call, so the order of a pool's line is known up to that
bracket; ``settled`` is written once settle returned (its admission passes included).
:func:`starved_heads` counts the heads of a line that waited over 100 ms while, by the
recorder, the slots they ask for were free (held from ``admit``/``start`` to ``settled``):
see :mod:`tests.support.starvation`. The children do not sleep between a settle and
the next admission of its slots, so each such wait is a wake-up no pass took.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue as queue_mod
import random
import resource
import sqlite3
import threading
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tests.support import starvation

#: Close of an interval that never ended.
OPEN_END = 2**63

#: Name of the recorder table (PostgreSQL runs).
PG_TABLE = "contention_log"

#: Demand shapes a child picks from, with weights; ``{}`` keys are pool indexes (0, 1).
SHAPES: list[tuple[dict[int, int], int]] = [
    ({0: 1}, 40),
    ({1: 1}, 25),
    ({0: 2}, 10),
    ({0: 1, 1: 1}, 15),
    ({0: 1, 1: 2}, 5),
    ({0: 3}, 5),
]


# --------------------------------------------------------------------------- recorder


class Recorder:
    """Append-only event log with a global order, independent of the pools tables.

    ``spec`` is a plain dict so it crosses the ``spawn`` boundary:
    ``{"kind": "pg", "table": ...}`` or ``{"kind": "sqlite", "path": ...}``.
    """

    def __init__(self, spec: dict[str, str]) -> None:
        self.spec = spec
        self._sqlite: sqlite3.Connection | None = None
        self._pg: Any = None
        self._mysql: Any = None

    # -- set-up / tear-down (parent) ------------------------------------------------
    @classmethod
    def create(cls, vendor: str, db_name: str) -> Recorder:
        if vendor == "postgresql":
            from django.db import connection

            d = connection.settings_dict
            params = {
                "dbname": db_name,
                "user": d.get("USER") or "",
                "password": d.get("PASSWORD") or "",
                "host": d.get("HOST") or "",
                "port": str(d.get("PORT") or ""),
            }
            rec = cls({"kind": "pg", "table": PG_TABLE, **{k: v for k, v in params.items() if v}})
            con = rec._pg_con()
            con.execute(f"DROP TABLE IF EXISTS {PG_TABLE}")
            con.execute(
                f"CREATE TABLE {PG_TABLE} (seq bigserial PRIMARY KEY, kind text NOT NULL, "
                "entry bigint, token bigint, demand text NOT NULL, proc int NOT NULL, "
                "mono bigint NOT NULL, priority int, began bigint)"
            )
            return rec
        if vendor == "mysql":
            from django.db import connection

            d = connection.settings_dict
            params = {
                "database": db_name,
                "user": d.get("USER") or "",
                "password": d.get("PASSWORD") or "",
                "host": d.get("HOST") or "",
                "port": str(d.get("PORT") or ""),
            }
            rec = cls(
                {"kind": "mysql", "table": PG_TABLE, **{k: v for k, v in params.items() if v}}
            )
            cur = rec._mysql_con().cursor()
            cur.execute(f"DROP TABLE IF EXISTS {PG_TABLE}")
            cur.execute(
                f"CREATE TABLE {PG_TABLE} (seq bigint AUTO_INCREMENT PRIMARY KEY, "
                "kind varchar(40) NOT NULL, entry bigint, token bigint, demand text NOT NULL, "
                "proc int NOT NULL, mono bigint NOT NULL, priority int, began bigint) ENGINE=InnoDB"
            )
            return rec
        path = os.path.join(
            os.path.dirname(os.path.abspath(db_name)), f"contention-{os.getpid()}.sqlite3"
        )
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(path + suffix):
                os.remove(path + suffix)
        rec = cls({"kind": "sqlite", "path": path})
        rec._sqlite_con().execute(
            "CREATE TABLE log (seq INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, "
            "entry INTEGER, token INTEGER, demand TEXT NOT NULL, proc INTEGER NOT NULL, "
            "mono INTEGER NOT NULL, priority INTEGER, began INTEGER)"
        )
        return rec

    def drop(self) -> None:
        if self.spec["kind"] == "pg":
            self._pg_con().execute(f"DROP TABLE IF EXISTS {PG_TABLE}")
        if self.spec["kind"] == "mysql":
            self._mysql_con().cursor().execute(f"DROP TABLE IF EXISTS {PG_TABLE}")
        self.close()
        if self.spec["kind"] == "sqlite":
            for suffix in ("", "-wal", "-shm"):
                if os.path.exists(self.spec["path"] + suffix):
                    os.remove(self.spec["path"] + suffix)

    def _pg_con(self) -> Any:
        """Own autocommit connection (not Django's): the pools sessions are left untouched.

        ``synchronous_commit=off`` only skips the WAL flush wait of the recorder's own
        commits; ``nextval`` still orders the events at the moment they are written.
        """
        if self._pg is None:
            import psycopg

            params: dict[str, Any] = {
                k: v for k, v in self.spec.items() if k not in {"kind", "table"}
            }
            self._pg = psycopg.connect(
                **params, autocommit=True, options="-c synchronous_commit=off"
            )
        return self._pg

    def _mysql_con(self) -> Any:
        """Own autocommit connection (not Django's), like :meth:`_pg_con`."""
        if self._mysql is None:
            import MySQLdb

            params: dict[str, Any] = {
                k: v for k, v in self.spec.items() if k not in {"kind", "table", "port"}
            }
            if "port" in self.spec:
                params["port"] = int(self.spec["port"])
            self._mysql = MySQLdb.connect(**params, autocommit=True)
        return self._mysql

    def _sqlite_con(self) -> sqlite3.Connection:
        if self._sqlite is None:
            con = sqlite3.connect(self.spec["path"], timeout=60, isolation_level=None)
            con.execute("PRAGMA journal_mode=WAL")
            con.execute("PRAGMA synchronous=NORMAL")
            self._sqlite = con
        return self._sqlite

    # -- writing (children) -----------------------------------------------------------
    def record(
        self,
        kind: str,
        entry: int | None,
        token: int | None,
        demand: dict[str, int],
        *,
        priority: int | None = None,
        began: int | None = None,
    ) -> None:
        """Append one event; its sequence number is taken when the row is written.

        ``priority`` and ``began`` (the clock before the call, ``time.monotonic_ns()``) are
        given with ``submit`` events: what :func:`stays` needs to know the line's order.
        """
        row = (kind, entry, token, json.dumps(demand, sort_keys=True), os.getpid())
        cols = "(kind, entry, token, demand, proc, mono, priority, began)"
        if self.spec["kind"] == "pg":
            self._pg_con().execute(
                f"INSERT INTO {self.spec['table']} {cols} VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
                [*row, time.monotonic_ns(), priority, began],
            )
        elif self.spec["kind"] == "mysql":
            self._mysql_con().cursor().execute(
                f"INSERT INTO {self.spec['table']} {cols} VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
                [*row, time.monotonic_ns(), priority, began],
            )
        else:
            self._sqlite_con().execute(
                f"INSERT INTO log {cols} VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (*row, time.monotonic_ns(), priority, began),
            )

    def close(self) -> None:
        """Close this process's recorder connection."""
        for con in (self._pg, self._mysql, self._sqlite):
            if con is not None:
                con.close()
        self._pg = self._mysql = self._sqlite = None

    # -- reading (parent) ----------------------------------------------------------------
    def events(self) -> list[Event]:
        """Every event, in the recorder's global order."""
        sql = (
            "SELECT seq, kind, entry, token, demand, proc, mono, priority, began FROM {} "
            "ORDER BY seq"
        )
        if self.spec["kind"] == "pg":
            rows = self._pg_con().execute(sql.format(self.spec["table"])).fetchall()
        elif self.spec["kind"] == "mysql":
            cur = self._mysql_con().cursor()
            cur.execute(sql.format(self.spec["table"]))
            rows = cur.fetchall()
        else:
            rows = self._sqlite_con().execute(sql.format("log")).fetchall()
        return [
            Event(
                seq=r[0],
                kind=r[1],
                entry=r[2],
                token=r[3],
                demand=json.loads(r[4]),
                proc=r[5],
                mono=r[6],
                priority=r[7],
                began=r[8],
            )
            for r in rows
        ]


@dataclass(frozen=True)
class Event:
    """One recorded event."""

    seq: int
    #: "submit" (after enqueue returned), "admit" (published by the bridge), "start",
    #: "end" (before settle), "settled" (after settle returned), "wake" (a wake-up asked for).
    kind: str
    entry: int | None
    token: int | None
    demand: dict[str, int]
    proc: int
    mono: int
    #: ``submit`` only: the entry's priority, and the clock just before enqueue was called.
    priority: int | None = None
    began: int | None = None


def intervals(
    events: Iterable[Event],
    *,
    key: str = "seq",
    opening: Sequence[str] = ("admit", "start"),
    closing: str = "end",
) -> list[tuple[int, int, dict[str, int]]]:
    """``(open, close, demand)`` per entry that was opened.

    An interval opens at the earliest of its ``opening`` events and closes at ``end``
    (never, i.e. :data:`OPEN_END`, for an entry that did not end).
    ``admit`` is written once the admitting transaction has committed (the bridge runs
    on commit) and ``start`` once ``leases.start`` returned; ``end`` is written before
    ``settle`` is called. So each interval lies inside the entry's real holding interval
    (admission commit .. settle commit). ``admit`` alone may come late (another process
    can start and end the entry before the admitting process writes it): the earliest
    opening event is used. ``closing="settled"`` closes at the settle's return instead.
    """
    opens: dict[int, int] = {}
    closes: dict[int, int] = {}
    demand: dict[int, dict[str, int]] = {}
    for e in events:
        if e.entry is None:
            continue
        at = getattr(e, key)
        if e.kind in opening:
            opens[e.entry] = min(at, opens.get(e.entry, at))
        if e.kind in {"start", "end"}:
            demand[e.entry] = e.demand
        if e.kind == closing:
            closes[e.entry] = at
    return [(at, closes.get(i, OPEN_END), demand[i]) for i, at in opens.items() if i in demand]


def sweep(
    events: Iterable[Event], *, key: str = "seq", opening: Sequence[str] = ("admit", "start")
) -> dict[str, int]:
    """Maximum slots held at once per pool, sweeping the :func:`intervals` in ``key`` order.

    The recorder's sequence has no ties. On the clock, at equal keys a close is applied
    before an open: a tie gives the benefit of the doubt to the code under test.
    """
    points = []
    for opened, closed, demand in intervals(events, key=key, opening=opening):
        points.append((opened, 1, demand))
        points.append((closed, 0, demand))
    points.sort(key=lambda p: (p[0], p[1]))
    current: Counter[str] = Counter()
    peak: Counter[str] = Counter()
    for _at, is_open, demand in points:
        for pool, slots in demand.items():
            current[pool] += slots if is_open else -slots
            peak[pool] = max(peak[pool], current[pool])
    return dict(peak)


def _seconds(ns: int) -> float:
    return ns / 1e9


def stays(events: Iterable[Event]) -> list[starvation.Stay]:
    """Each submitted entry's stay in line, on the clock (seconds).

    Its place (``enqueued_at``) was taken inside the enqueue call: between ``began`` and the
    ``submit`` event. It may be in line from ``began``, is surely in line from ``submit``, and
    leaves the line at its first ``admit`` or ``start`` (the earliest record of its admission).
    """
    submits: dict[int, Event] = {}
    admitted: dict[int, int] = {}
    for e in events:
        if e.entry is None:
            continue
        if e.kind == "submit":
            submits[e.entry] = e
        elif e.kind in {"admit", "start"}:
            admitted[e.entry] = min(e.mono, admitted.get(e.entry, e.mono))
    out = []
    for entry, s in submits.items():
        began = s.mono if s.began is None else s.began
        left = admitted.get(entry)
        out.append(
            starvation.Stay(
                entry=entry,
                demand=s.demand,
                priority=s.priority or 0,
                enqueued_lo=_seconds(began),
                enqueued_hi=_seconds(s.mono),
                possibly_from=_seconds(began),
                surely_from=_seconds(s.mono),
                until=starvation.FOREVER if left is None else _seconds(left),
            )
        )
    return out


def holds(events: Iterable[Event]) -> list[starvation.Hold]:
    """Slots held, on the clock (seconds): from the first ``admit``/``start`` of an entry to
    its ``settled`` (written once settle has returned, so after its admission pass; never
    freed if it has none). Unlike :func:`intervals` (which proves no oversubscription, so
    closes at ``end``), a slot counts as held until the database surely freed it.
    """
    return [
        starvation.Hold(
            demand, _seconds(opened), starvation.FOREVER if closed == OPEN_END else _seconds(closed)
        )
        for opened, closed, demand in intervals(events, key="mono", closing="settled")
    ]


def starved_heads(events: Sequence[Event], capacity: dict[str, int]) -> list[starvation.Episode]:
    """Lost wake-ups: heads that waited over :data:`starvation.THRESHOLD` with free slots.

    See :mod:`tests.support.starvation` for what is counted and why no record written late
    (a process descheduled between a commit and its record aside) counts as one.
    """
    return starvation.starved_heads(stays(events), holds(events), capacity)


# --------------------------------------------------------------------------- the bridge


class _RecorderBridge:
    """``POOLS["PUBLISHER"]`` in the children: writes an ``admit`` event per admission."""

    recorder: Recorder | None = None

    def publish(self, admissions: Sequence[Any]) -> None:
        assert self.recorder is not None
        for a in admissions:
            self.recorder.record("admit", a.entry_id, a.token, {})

    def report_finished(self, finished: Sequence[Any]) -> None:
        assert self.recorder is not None
        for f in finished:
            self.recorder.record(f"finished:{f.state}", f.entry_id, None, {})

    def wake_at(self, pools: Sequence[str], when: Any) -> None:
        """A pass asked for later (a failed follow-up): recorded, never run (no timer here)."""
        assert self.recorder is not None
        self.recorder.record("wake", None, None, dict.fromkeys(pools, 0))


#: Dotted path ``tests.support.contention.publisher``.
publisher = _RecorderBridge()


# --------------------------------------------------------------------------- children


@dataclass(frozen=True, kw_only=True)
class ChildConfig:
    """Everything one child needs (picklable)."""

    index: int
    settings_module: str
    vendor: str
    db_name: str
    recorder: dict[str, str]
    pools: list[str]
    submit: int
    total: int
    seed: int
    max_hold: float
    stall_seconds: float
    #: The child gives up (reporting the entry states) this long after the start signal.
    run_seconds: float
    #: Run with ``POOLS["SQL_FAST_PATH"]`` set to this (PostgreSQL: which path is proven).
    fast_path: bool = True
    #: Self-test of the checker only: the ORM path's admission ignores held slots here.
    sabotage: bool = False
    #: Self-test of the lost wake-up count only: settle frees the slots without an admission
    #: pass, and child 0 runs a pass over the pools every :data:`SWEEP_SECONDS` instead.
    lose_wakeups: bool = False


def _setup_django(cfg: ChildConfig) -> None:
    os.environ["DJANGO_SETTINGS_MODULE"] = cfg.settings_module
    if cfg.vendor == "postgresql":
        os.environ["POOLS_TEST_DB"] = "postgres"
        os.environ["POOLS_PG_NAME"] = cfg.db_name
    elif cfg.vendor == "mysql":
        os.environ["POOLS_TEST_DB"] = "mysql"
        os.environ["POOLS_MYSQL_NAME"] = cfg.db_name
    else:
        os.environ["POOLS_TEST_DB"] = "sqlite"
        os.environ["POOLS_SQLITE_DIR"] = os.path.dirname(os.path.abspath(cfg.db_name))
    from django.conf import settings

    # The test database, not the settings' default one (SQLite file names differ).
    settings.DATABASES["default"]["NAME"] = cfg.db_name
    settings.POOLS = {
        **settings.POOLS,
        "PUBLISHER": "tests.support.contention.publisher",
        "SQL_FAST_PATH": cfg.fast_path,
    }

    import django

    django.setup()
    from django.db import connection

    assert connection.vendor == cfg.vendor, (connection.vendor, cfg.vendor)


@dataclass
class ChildStats:
    """What one child did (sent back to the parent)."""

    index: int
    pid: int = 0
    submitted: int = 0
    admitted_on_enqueue: int = 0
    started: int = 0
    settled: int = 0
    lost_claims: int = 0
    polls: int = 0
    #: Seconds spent in each kind of call (enqueue, poll, start, hold, settle, idle).
    seconds: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    #: Slowest single call of each kind, in seconds.
    slowest: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    failure: str = ""
    #: Whether this child's enqueue/settle/start ran as stored-function calls.
    fast_path: bool = False


def child_main(cfg: ChildConfig, barrier: Any, out: Any) -> None:
    """Entry point of one spawned process."""
    stats = ChildStats(index=cfg.index, pid=os.getpid())
    try:
        try:
            _setup_django(cfg)
        except BaseException:
            barrier.abort()  # the parent stops waiting for the start signal
            raise
        _child_loop(cfg, barrier, stats)
    except BaseException:  # report everything, including the stall check
        stats.failure = traceback.format_exc()
    finally:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        stats.seconds["cpu"] = usage.ru_utime + usage.ru_stime
        if publisher.recorder is not None:
            publisher.recorder.close()
        try:
            from django.db import connections

            connections.close_all()
        except Exception:  # pragma: no cover - best effort
            pass
        out.put(stats)


class _Timer:
    def __init__(self, stats: ChildStats, what: str) -> None:
        self.stats, self.what = stats, what

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        took = time.perf_counter() - self.t0
        self.stats.seconds[self.what] += took
        self.stats.slowest[self.what] = max(self.stats.slowest.get(self.what, 0.0), took)


def _retrying(stats: ChildStats, what: str, fn: Any, *args: Any) -> Any:
    """Call ``fn``; on PoolUnavailable (e.g. 'database is locked') log it and retry."""
    from pools.exceptions import PoolUnavailable

    for attempt in range(20):
        try:
            with _Timer(stats, what):
                return fn(*args)
        except PoolUnavailable as exc:
            stats.errors.append(f"{what} attempt {attempt}: {exc}")
            time.sleep(0.05)
    raise RuntimeError(f"{what}: PoolUnavailable 20 times in a row")


def _child_loop(cfg: ChildConfig, barrier: Any, stats: ChildStats) -> None:
    from pools.core import admission, admission_pass, leases
    from pools.core.records import Submission
    from pools.models import QueueEntry
    from pools.pg import fastpath
    from pools.specs import PoolSpec

    if cfg.sabotage:
        admission_pass.held_by_pool = lambda pools: {}
    settle = _settle_without_admission if cfg.lose_wakeups else admission.settle
    stats.fast_path = fastpath.enabled()
    rec = Recorder(cfg.recorder)
    publisher.recorder = rec
    rng = random.Random(cfg.seed * 1000 + cfg.index)
    shapes = [s for s, _ in SHAPES]
    weights = [w for _, w in SHAPES]
    worker = f"conc-{cfg.index}@{os.getpid()}"
    usage = resource.getrusage(resource.RUSAGE_SELF)
    stats.seconds["cpu_setup"] = usage.ru_utime + usage.ru_stime
    barrier.wait(timeout=120)

    deadline = time.monotonic() + cfg.run_seconds
    left = cfg.submit
    last_progress = next_check = next_sweep = time.monotonic()
    last_done = -1
    backoff = 0.001
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"child {cfg.index}: gave up after {cfg.run_seconds:.0f}s ({_states()})"
            )
        if left:
            shape = rng.choices(shapes, weights)[0]
            demand = {cfg.pools[i]: n for i, n in shape.items()}
            spec = PoolSpec.build(demand, priority=rng.randint(0, 3))
            sub = Submission(
                key=f"conc-{cfg.index}-{left}", task_name="tests.support.contention", spec=spec
            )
            began = time.monotonic_ns()
            res = _retrying(stats, "enqueue", admission.enqueue, sub)
            rec.record("submit", res.entry_id, None, demand, priority=spec.priority, began=began)
            stats.submitted += 1
            stats.admitted_on_enqueue += int(res.admitted)
            left -= 1
        stats.polls += 1
        with _Timer(stats, "poll"):
            candidates = list(
                QueueEntry.objects.filter(state="admitted").values_list(
                    "queue_id", "token", "demand"
                )[:16]
            )
        rng.shuffle(candidates)
        worked = False
        for queue_id, token, demand in candidates:
            with _Timer(stats, "start"):
                claim = leases.start(queue_id, token, worker=worker)
            if claim is None:
                stats.lost_claims += 1
                continue
            stats.started += 1
            with _Timer(stats, "hold"):
                rec.record("start", queue_id, token, demand)
                time.sleep(rng.uniform(0, cfg.max_hold))
                rec.record("end", queue_id, token, demand)
            if not _retrying(stats, "settle", settle, queue_id, token, "succeeded"):
                raise AssertionError(f"settle({queue_id}, {token}) refused a fresh claim")
            rec.record("settled", queue_id, token, demand)
            stats.settled += 1
            worked = True
            break
        if worked or left:
            backoff = 0.001
            continue
        now = time.monotonic()
        if cfg.lose_wakeups and cfg.index == 0 and now >= next_sweep:
            next_sweep = now + SWEEP_SECONDS
            _retrying(stats, "sweep", admission.admit, cfg.pools)
        if now >= next_check:
            next_check = now + 0.05
            with _Timer(stats, "poll"):
                done = QueueEntry.objects.filter(state="succeeded").count()
            if done >= cfg.total:
                return
            if done != last_done:
                last_done, last_progress = done, now
            elif now - last_progress > cfg.stall_seconds:
                # Work is left but nothing finished for a long time: a lost wake-up.
                raise AssertionError(
                    f"child {cfg.index}: no entry finished for {cfg.stall_seconds:.0f}s "
                    f"({_states()})"
                )
        with _Timer(stats, "idle"):  # nothing claimed: back off instead of spinning
            time.sleep(rng.uniform(backoff / 2, backoff))
        backoff = min(backoff * 2, 0.032)


#: How often child 0 runs an admission pass when settles lose their wake-ups (a sweep).
SWEEP_SECONDS = 0.5


def _settle_without_admission(entry_id: int, token: int, outcome: str) -> bool:
    """A settle that frees the slots but runs no admission pass: every wake-up is lost.

    The ORM settle (on either path: both keep the same rows) with its admission pass and
    follow-up pass replaced by nothing; the self-test of :func:`starved_heads`.
    """
    from unittest import mock

    from pools.core import settling

    with (
        mock.patch.object(settling, "admit_in", lambda *args, **kwargs: set()),
        mock.patch.object(settling, "follow_up", lambda needs: []),
    ):
        return settling.settle_with_locks(entry_id, token, outcome)


def _states() -> str:
    from django.db.models import Count

    from pools.models import QueueEntry

    rows = QueueEntry.objects.values("state").annotate(n=Count("pk")).order_by("state")
    return ", ".join(f"{r['state']}={r['n']}" for r in rows)


# --------------------------------------------------------------------------- SQL sabotage

#: The statement of the admit function that reads the held slots (see schema.sql).
HELD_SUM_SQL = """        v_free := r.slots - r.held;"""


def _admission_sql() -> str:
    from pools.pg import sqlfile

    return sqlfile.read("schema.sql")


def install_sabotaged_sql() -> None:
    """Replace the admit function in the test database by a copy that ignores held slots.

    The self-test of the proof on the fast path: only the stored function is broken
    (multi-pool heads still go through the intact Python pass).
    """
    from django.db import connection

    text = _admission_sql()
    if HELD_SUM_SQL not in text:
        raise RuntimeError("schema.sql changed: update HELD_SUM_SQL in tests/support/contention.py")
    with connection.cursor() as cursor:
        cursor.execute(text.replace(HELD_SUM_SQL, "        v_free := r.slots;  -- SABOTAGED"))


def restore_sql() -> None:
    """Re-create the shipped functions (undo :func:`install_sabotaged_sql`)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(_admission_sql())


# --------------------------------------------------------------------------- parent


@dataclass
class Result:
    """Outcome of :func:`run`."""

    vendor: str
    entries: int
    processes: int
    capacity: dict[str, int]
    elapsed: float
    events: list[Event]
    children: list[ChildStats]
    timed_out: bool = False
    states: dict[str, int] = field(default_factory=dict)
    #: True when the children ran enqueue/settle/start as stored-function calls.
    fast_path: bool = False

    @property
    def max_held(self) -> dict[str, int]:
        """Peak slots held per pool, by the recorder's global sequence."""
        return sweep(self.events, key="seq")

    @property
    def max_held_by_clock(self) -> dict[str, int]:
        """Peak slots held per pool, by the system-wide monotonic clock."""
        return sweep(self.events, key="mono")

    @property
    def max_running(self) -> dict[str, int]:
        """Peak slots of started (running) entries per pool: start .. end only."""
        return sweep(self.events, key="seq", opening=("start",))

    @property
    def starved(self) -> list[starvation.Episode]:
        """Lost wake-ups: heads that waited over 100 ms while their slots were free."""
        return starved_heads(self.events, self.capacity)

    def count(self, kind: str) -> Counter[int | None]:
        """How many events of ``kind`` each entry has."""
        return Counter(e.entry for e in self.events if e.kind == kind)

    @property
    def failures(self) -> list[str]:
        return [f"child {c.index}:\n{c.failure}" for c in self.children if c.failure]

    @property
    def errors(self) -> list[str]:
        return [f"child {c.index}: {err}" for c in self.children for err in c.errors]

    def timings(self) -> str:
        """Seconds per kind of call, summed over the children, and the slowest call."""
        total: defaultdict[str, float] = defaultdict(float)
        slowest: dict[str, float] = {}
        for c in self.children:
            for k, seconds in c.seconds.items():
                total[k] += seconds
            for k, v in c.slowest.items():
                slowest[k] = max(slowest.get(k, 0.0), v)
        return ", ".join(
            f"{k} {total[k]:.2f}s (max {slowest.get(k, 0.0) * 1000:.0f}ms)" for k in sorted(total)
        )

    def summary(self) -> str:
        rate = self.entries / self.elapsed if self.elapsed else 0.0
        return (
            f"contention[{self.vendor}, {'sql' if self.fast_path else 'orm'} path]: "
            f"{self.entries} entries, {self.processes} processes, "
            f"capacity {self.capacity}: {self.elapsed:.2f}s ({rate:.0f} entries/s); "
            f"peak held {self.max_held} (clock: {self.max_held_by_clock}, "
            f"running: {self.max_running}); starved heads {len(self.starved)}; "
            f"admitted on enqueue {sum(c.admitted_on_enqueue for c in self.children)}, "
            f"lost claims {sum(c.lost_claims for c in self.children)}, "
            f"polls {sum(c.polls for c in self.children)}, "
            f"retried PoolUnavailable {len(self.errors)}; time in calls: {self.timings()}"
        )


def run(
    *,
    entries: int,
    processes: int = 8,
    pools: dict[str, int] | None = None,
    timeout: float = 240.0,
    max_hold: float = 0.003,
    stall_seconds: float = 20.0,
    seed: int = 1,
    sabotage: bool = False,
    lose_wakeups: bool = False,
    fast_path: bool | None = None,
) -> Result:
    """Run the contention scenario against the current default database.

    Must be called from a test that commits (``django_db(transaction=True)``): the children
    read the pools created here. Creates the pools (two, named by ``pools``) and the
    recorder, starts ``processes`` children, waits at most ``timeout`` seconds (children are
    terminated and ``Result.timed_out`` is set when it passes), and drops the recorder.
    ``fast_path`` picks the path on PostgreSQL (default: the settings'; SQLite always
    runs the ORM path). ``sabotage=True`` breaks the admission *of the path under test* so
    that it ignores held slots: the ORM pass in the children, or on the fast path the
    stored admit function (a sabotaged copy installed in the test database
    for the run). A self-test showing that the recorder and :func:`sweep` do catch
    oversubscription on that path. ``lose_wakeups=True``: settles free the slots without
    an admission pass, and one child sweeps every :data:`SWEEP_SECONDS` (a self-test
    showing that :func:`starved_heads` catches lost wake-ups).
    """
    from django.conf import settings
    from django.db import connection
    from django.db.models import Count

    from pools.models import Pool, QueueEntry

    pools = pools or {"conc-a": 3, "conc-b": 3}
    if len(pools) != 2:
        raise ValueError("run() needs exactly two pools")
    for name, slots in pools.items():
        Pool.objects.update_or_create(name=name, defaults={"slots": slots, "paused": False})
    db_name = str(connection.settings_dict["NAME"])
    if connection.vendor == "sqlite" and (db_name == ":memory:" or "mode=memory" in db_name):
        raise RuntimeError("the contention run needs a file database, not an in-memory one")

    from pools.pg import fastpath

    if fast_path is None:
        fast_path = fastpath.enabled()
    fast_path = fast_path and connection.vendor == "postgresql"
    recorder = Recorder.create(connection.vendor, db_name)
    if sabotage and fast_path:
        install_sabotaged_sql()
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(processes + 1)
    out = ctx.Queue()
    shares = [
        entries // processes + (1 if i < entries % processes else 0) for i in range(processes)
    ]
    procs = []
    children: list[ChildStats] = []
    timed_out = False
    try:
        for i in range(processes):
            cfg = ChildConfig(
                index=i,
                settings_module=settings.SETTINGS_MODULE,
                vendor=connection.vendor,
                db_name=db_name,
                recorder=recorder.spec,
                pools=list(pools),
                submit=shares[i],
                total=entries,
                seed=seed,
                max_hold=max_hold,
                stall_seconds=stall_seconds,
                run_seconds=max(1.0, timeout - 10),
                sabotage=sabotage and not fast_path,
                lose_wakeups=lose_wakeups,
                fast_path=fast_path,
            )
            p = ctx.Process(target=child_main, args=(cfg, barrier, out), name=f"contention-{i}")
            p.start()
            procs.append(p)
        try:
            barrier.wait(timeout=120)  # spawning + django.setup()
        except threading.BrokenBarrierError:
            for _ in procs:
                try:
                    children.append(out.get(timeout=10))
                except queue_mod.Empty:
                    break
            failures = "\n".join(c.failure for c in children if c.failure)
            raise RuntimeError(f"contention children failed to start:\n{failures}") from None
        began = time.perf_counter()
        deadline = time.monotonic() + timeout
        while len(children) < processes:
            try:
                children.append(out.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue_mod.Empty:
                timed_out = True
                break
        elapsed = time.perf_counter() - began
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
        out.close()
        out.join_thread()
        try:
            events = recorder.events()
            states = dict(
                QueueEntry.objects.values_list("state").annotate(n=Count("pk")).order_by()
            )
        finally:
            recorder.drop()
            if sabotage and fast_path:
                restore_sql()
    return Result(
        vendor=connection.vendor,
        entries=entries,
        processes=processes,
        capacity=dict(pools),
        elapsed=elapsed,
        events=events,
        children=sorted(children, key=lambda c: c.index),
        timed_out=timed_out,
        states=states,
        fast_path=fast_path,
    )
