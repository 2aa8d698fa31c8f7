"""The two admission paths are one contract: a differential test on random operation sequences.

A seeded generator drives the same sequence of operations (submits across pools with
priorities, multi-pool demands, ``not_before`` ahead and already due, deadlines and
Celery ``expires``, unknown pools, demands above capacity, full backlogs; starts with
fresh and stale tokens and long worker names, renewals, settles with every outcome and
with lapsed leases, cancels with and without ``terminate``, requeues, lapsed leases
found by the sweep, expiries, admission passes, a clock that moves, and the pool policies:
capacity changes that drain, pause and resume, overflow and paused policies, ``forbid``
entries of a job and entries pinned to a worker that is or is not live; the strategies
``priority`` (with and without aging), ``fifo``, ``lifo`` and ``fair`` with fairness keys,
and changes of strategy while entries wait; a pool with two rates, changes of rates)
once through the
PostgreSQL stored functions (``SQL_FAST_PATH=True``) and once through the ORM path, on
the same test database emptied in between. The clock is fake (``timezone.now``, and the
database clock of the rate windows: ``pools.core.rates.db_now`` on the ORM path, the
``pools.clock`` setting that the admit function reads instead of ``clock_timestamp()`` on
the fast path), so both runs see the same times.

After every step both runs must agree on: the exception class raised (or none), the
value returned, what was handed to the bridge (publishes, finished entries,
terminations, timed wake-ups), the signals sent, and the whole stored state: entries,
demand rows, pools' next due times and event rows, compared by key (ids may differ) with
times as offsets from the start of the run. The first step where they differ fails the
test with both sides.

Targets of an operation (which entry to start, settle, cancel...) are picked from the
database's state, so as long as the runs agree they pick the same targets.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from unittest import mock

import pytest
from django.db import connection
from pytest_django import Settings

from pools import signals
from pools.core import admission, capacity, dispatch, leases, nodes, pool_crud, records, sweeps
from pools.core.records import Submission
from pools.exceptions import PoolError
from pools.models import Demand, Pool, PoolEvent, QueueEntry, RateMark
from pools.specs import PoolSpec
from pools.states import EventKind
from tests.conftest import POOL_APPS
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True, available_apps=POOL_APPS),
]

#: Operations per run (each seed runs them on both paths).
STEPS = int(os.environ.get("POOLS_DIFFERENTIAL_STEPS", "200"))
#: Seeds (``POOLS_DIFFERENTIAL_SEEDS=1-50`` for a longer hunt).
DEFAULT_SEEDS = [11, 33, 44]
_SEEDS = os.environ.get("POOLS_DIFFERENTIAL_SEEDS", ",".join(map(str, DEFAULT_SEEDS)))
SEEDS = (
    list(range(int(_SEEDS.split("-")[0]), int(_SEEDS.split("-")[1]) + 1))
    if "-" in _SEEDS
    else [int(s) for s in _SEEDS.split(",")]
)
#: Stored arguments of submits, in turn (without a random draw, so the seeds' sequences
#: stay as they were): empty means the plain ``[n]`` / ``{"n": key}``.
ARGUMENTS: list[tuple[Any, Any]] = [
    (None, None),
    ("(datetime.date(2026, 12, 5),)", "{}"),
    (
        "(UUID('6a1c3b52-0f7e-4f0e-9d55-2f1b1b7a9c01'), Decimal('1.10'))",
        "{'at': datetime.datetime(2026, 12, 5, 10, 0, tzinfo=datetime.timezone.utc)}",
    ),
    (None, None),
    ("(b'\\x00\\xff', [datetime.date(2026, 1, 1)])", "{'raw': b'\\x01', 'nul': '\x00'}"),
    ([["2026-12-05", {"d": "1.10", "n": None}], True, 1.5, '"quoted"'], {"k": [None, {}]}),
]
#: The pools: name -> (slots, max_queued).
POOLS = {"a": (2, None), "b": (1, None), "c": (3, 2), "d": (1, 1), "e": (3, None)}
#: Their strategies at the start (changed by ``pool`` operations, but "a" stays ``fair``).
STRATEGIES: dict[str, dict[str, Any]] = {
    "a": {"strategy": "fair"},
    "b": {"strategy": "priority", "aging_seconds": 5},
    "c": {"strategy": "lifo"},
    "d": {"strategy": "priority"},
    "e": {"strategy": "priority", "rate": "2/s,4/m"},
}
#: Fairness keys of submits ("" is the keyless group).
KEYS = ["t1", "t1", "t2", "t3", ""]
UNKNOWN = "zz-missing"
START = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)


class Clock:
    """The fake ``timezone.now`` of a run."""

    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> datetime:
        return self.now


def offset(value: datetime | None) -> float | None:
    """A time as seconds after the start of the run (ids and wall clocks differ; this does not)."""
    return None if value is None else round((value - START).total_seconds(), 6)


def plain(value: Any) -> Any:
    """Times as offsets, everything else as JSON-comparable data."""
    if isinstance(value, datetime):
        return offset(value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in sorted(value.items())}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


# --------------------------------------------------------------------------- observing


@dataclass
class Step:
    """What one operation did, as compared between the paths."""

    op: str
    raised: str | None
    returned: Any
    bridge: Any
    heard: Any
    state: Any = field(repr=False)


def snapshot() -> dict[str, Any]:
    """The stored state, keyed by entry key (and pool name), times as offsets."""
    entries = {
        e.key: plain(
            {
                "state": e.state,
                "demand": e.demand,
                "priority": e.priority,
                "enqueued_at": e.enqueued_at,
                "not_before": e.not_before,
                "deadline": e.deadline,
                "token": e.token,
                "lease_expires_at": e.lease_expires_at,
                "worker": e.worker,
                "reason": e.reason,
                "attempt": e.attempt,
                "admitted_at": e.admitted_at,
                "admission_seq": e.admission_seq,
                "started_at": e.started_at,
                "finished_at": e.finished_at,
                "args": e.args,
                "kwargs": e.kwargs,
                "options": e.options,
                "job": e.job,
                "concurrency_policy": e.concurrency_policy,
                "pinned_worker": e.pinned_worker,
                "fairness_key": e.fairness_key,
            }
        )
        for e in QueueEntry.objects.all()
    }
    demands = sorted(
        (
            d.entry.key,
            d.pool.name,
            d.slots,
            d.state,
            d.priority,
            offset(d.enqueued_at),
            d.line_round,
            offset(d.line_at),
            d.fairness_key,
        )
        for d in Demand.objects.select_related("entry", "pool")
    )
    pools = {
        p.name: (
            offset(p.next_due_at),
            p.slots,
            p.pending_slots,
            p.paused,
            p.overflow,
            p.paused_policy,
            p.held,
            p.strategy,
            p.aging_seconds,
            p.fair_round,
            p.rate,
            p.admissions,
        )
        for p in Pool.objects.all()
    }
    marks = sorted(
        (m.pool.name, m.rate_index, m.slot, offset(m.at))
        for m in RateMark.objects.select_related("pool")
    )
    return {
        "entries": entries,
        "demands": demands,
        "pools": pools,
        "marks": marks,
        "events": event_log(),
    }


def event_log() -> dict[str, list[Any]]:
    """The event stream (logged rows and the transitions the entries carry) per entry key,
    in order; the events of one operation for the pools of one entry (same kind and token)
    form one group, compared as a set."""
    from pools.core import events

    groups: dict[str, list[Any]] = {}
    for ev in events.stream(QueueEntry.objects.all(), PoolEvent.objects.order_by("id")):
        per_key = groups.setdefault(ev.key or f"pool:{ev.pool}", [])
        head = (ev.kind, ev.token, offset(ev.at))
        item = (ev.pool, json.dumps(ev.detail, sort_keys=True))
        if per_key and per_key[-1][0] == head:
            per_key[-1][1].append(item)
        else:
            per_key.append((head, [item]))
    return {k: [(h, sorted(items)) for h, items in v] for k, v in groups.items()}


class Listener:
    """Every lifecycle signal sent, normalized like the event log."""

    def __init__(self) -> None:
        self.heard: list[tuple[Any, ...]] = []

    def __call__(self, sender: Any, event: PoolEvent, **kwargs: Any) -> None:
        self.heard.append(
            (event.kind, event.key, event.pool, event.token, offset(event.at), event.detail)
        )

    def take(self) -> list[Any]:
        heard, self.heard = self.heard, []
        return sorted(json.dumps(h, sort_keys=True, default=str) for h in heard)


def bridge_output(rec: Any) -> dict[str, Any]:
    """What the core handed to the bridge during the step (order-free within the step)."""
    out = {
        "published": sorted(
            (a.key, a.token, a.task_name, json.dumps([a.args, a.kwargs, a.options], sort_keys=True))
            for a in rec.admissions
        ),
        "finished": sorted(
            (f.key, f.state, f.pool, f.reason, offset(f.deadline)) for f in rec.finished
        ),
        "terminated": sorted(rec.terminated),
        "wakes": sorted((tuple(sorted(p)), offset(w)) for p, w in rec.wakes),
    }
    rec.reset()
    return out


def summary(value: Any) -> Any:
    """A return value in path-independent form."""
    if isinstance(value, records.Enqueued):
        return {"enqueued": value.key, "admitted": value.admitted}
    if isinstance(value, leases.Claim):
        return {"claim": value.demand, "lease": offset(value.lease_expires_at)}
    if isinstance(value, QueueEntry):
        return {"entry": value.key, "state": value.state, "reason": value.reason}
    if isinstance(value, list) and value and isinstance(value[0], records.Admission):
        return sorted(a.key for a in value)
    if isinstance(value, sweeps.SweepReport):
        return [value.requeued, value.expired, value.admitted, value.pruned]
    return plain(value)


# --------------------------------------------------------------------------- operations


class Run:
    """One path's run of a seeded operation sequence."""

    def __init__(self, seed: int, clock: Clock) -> None:
        self.rng = random.Random(seed)
        self.clock = clock
        self.submitted = 0

    def entries(self, *states: str) -> list[tuple[str, int, int]]:
        query = QueueEntry.objects.order_by("key")
        if states:
            query = query.filter(state__in=states)
        return list(query.values_list("key", "queue_id", "token"))

    def pick(self, *states: str) -> tuple[str, int, int] | None:
        found = self.entries(*states)
        return self.rng.choice(found) if found else None

    def next_op(self) -> tuple[str, Callable[[], Any]]:
        """Choose an operation from the current state (same state -> same choice)."""
        rng = self.rng
        kind = rng.choices(
            [
                "submit", "start", "start_stale", "renew", "settle", "settle_stale",
                "cancel", "terminate", "requeue", "advance", "sweep", "expire", "admit",
                "pool", "node",
            ],
            [30, 12, 2, 4, 12, 3, 6, 3, 3, 8, 4, 2, 3, 4, 1],
        )[0]  # fmt: skip
        if kind == "submit":
            return self.submit()
        if kind == "pool":
            return self.pool_change()
        if kind == "node":
            return "heartbeat w2@host", lambda: nodes.beat("w2@host")
        if kind in {"start", "start_stale"}:
            target = self.pick("admitted", "running" if kind == "start_stale" else "admitted")
            if target is None:
                return self.submit()
            key, entry_id, token = target
            if kind == "start_stale":
                token -= rng.choice([0, 1])  # a repeated delivery or an older one
            worker = rng.choice(["w1", "w2@host", "w" * 300])
            return f"start {key} t{token} {worker[:8]}", lambda: leases.start(
                entry_id, token, worker=worker
            )
        if kind == "renew":
            target = self.pick("admitted", "running", "succeeded")
            if target is None:
                return self.advance()
            key, entry_id, token = target
            # The first renewal after a fenced start marks the entry running.
            started = self.clock.now if rng.random() < 0.3 else None
            return f"renew {key} fenced={started is not None}", lambda: leases.renew(
                entry_id, token, started_at=started, worker="w1"
            )
        if kind in {"settle", "settle_stale"}:
            states = ("admitted", "running") if kind == "settle" else ("succeeded", "waiting")
            target = self.pick(*states)
            if target is None:
                return self.advance()
            key, entry_id, token = target
            outcome = rng.choice(["succeeded", "succeeded", "failed", "retried"])
            live = rng.random() < 0.5
            # A worker passes when and where the body started (a fenced start wrote neither).
            fenced = rng.random() < 0.5
            started = self.clock.now - timedelta(seconds=1) if fenced else None
            worker = rng.choice(["w1", "w" * 300]) if fenced else ""
            return (
                f"settle {key} t{token} {outcome} live={live} fenced={fenced}",
                lambda: admission.settle(
                    entry_id,
                    token,
                    outcome,
                    reason="",
                    live_lease=live,
                    started_at=started,
                    worker=worker,
                ),
            )
        if kind in {"cancel", "terminate"}:
            target = self.pick("waiting") if rng.random() < 0.6 else self.pick()
            key = target[0] if target and rng.random() < 0.9 else "no-such-key"
            terminate = kind == "terminate"
            return f"cancel {key} terminate={terminate}", lambda: admission.cancel(
                key, terminate=terminate
            )
        if kind == "requeue":
            target = self.pick("admitted", "running")
            if target is None:
                return self.advance()
            key, entry_id, token = target
            admit = rng.random() < 0.7
            return f"requeue {key} admit={admit}", lambda: admission.requeue(
                entry_id, token, reason="lease lost", admit=admit
            )
        if kind == "advance":
            return self.advance()
        if kind == "sweep":
            return "sweep", lambda: sweeps.sweep(self.clock.now)
        if kind == "expire":
            return "expire_due", lambda: admission.expire_due(self.clock.now)
        pool = rng.choice([*POOLS, UNKNOWN])
        return f"admit {pool}", lambda: admission.admit([pool])

    def pool_change(self) -> tuple[str, Callable[[], Any]]:
        """A pool policy change through the service functions (returns nothing to compare)."""
        rng = self.rng
        name = rng.choice(list(POOLS))
        ops = ["slots", "slots", "pause", "resume", "overflow", "paused_policy", "rate"]
        what = rng.choice([*ops, "strategy", "strategy", "aging"])
        if what == "strategy" and name != "a":  # "a" stays fair: keys compete there
            strategy = rng.choice(["priority", "fifo", "lifo", "fair"])
            aging = rng.choice([None, 3]) if strategy == "priority" else None

            def reorder() -> None:
                pool_crud.update_pool(name, strategy=strategy, aging_seconds=aging)

            return f"{name}.strategy={strategy} aging={aging}", reorder
        if what == "aging":  # refused (PoolConfigurationError) unless the pool is 'priority'
            seconds = rng.choice([None, 2, 10])
            return f"{name}.aging_seconds={seconds}", lambda: pool_crud.update_pool(
                name, aging_seconds=seconds
            )
        if what == "pause" or what == "resume":
            paused = what == "pause"
            return f"{what} {name}", lambda: capacity.set_paused(name, paused)
        value: Any
        if what == "slots":
            value = rng.choice([1, 2, 3, 4])
        elif what == "overflow":
            value = rng.choice(["reject", "drop_oldest", "drop_newest"])
        elif what == "rate":
            value = rng.choice(["", "1/s", "2/s,4/m"])
        else:
            value = rng.choice(["queue", "reject"])

        def change() -> None:
            pool_crud.update_pool(name, **{what: value})

        return f"{name}.{what}={value}", change

    def advance(self) -> tuple[str, Callable[[], Any]]:
        seconds = self.rng.choice([0.5, 1, 3, 10, 31, 45])

        def move() -> None:
            self.clock.now += timedelta(seconds=seconds)

        return f"advance {seconds}s", move

    def submit(self) -> tuple[str, Callable[[], Any]]:
        rng = self.rng
        self.submitted += 1
        key = f"e{self.submitted:04d}"
        names = list(POOLS)
        shape = rng.random()
        if shape < 0.55:
            demand = {rng.choice(names): rng.choice([1, 1, 1, 2, 3])}
        elif shape < 0.85:
            first, second = rng.sample(names, 2)
            demand = {first: 1, second: rng.choice([1, 1, 2])}
        else:  # refusals competing: unknown pool, full backlog, demand above capacity
            demand = {UNKNOWN: 1, "d": 1} if rng.random() < 0.5 else {"b": 2, "d": 1, "c": 1}
            if rng.random() < 0.3:
                demand.pop(UNKNOWN, None)
        now = self.clock.now
        not_before = rng.choice([None, None, None, now - timedelta(seconds=5)]) or (
            now + timedelta(seconds=rng.choice([2, 20])) if rng.random() < 0.2 else None
        )
        timeout = rng.choice([None, None, 5.0, 40.0])
        expires = now + timedelta(seconds=15) if rng.random() < 0.1 else None
        job = rng.choice(["j1", "j1", "j2"]) if rng.random() < 0.3 else ""
        pinned = rng.choice(["w2@host", "w9@gone"]) if rng.random() < 0.08 else ""
        options = {"expires": expires.isoformat()} if expires else {}
        spec = PoolSpec.build(demand, priority=rng.randint(0, 3), queue_timeout=timeout)
        fairness_key = rng.choice(KEYS)
        number = rng.randint(0, 9)  # drawn for every submit: the seeds' sequences stay as they were
        shown_args, shown_kwargs = ARGUMENTS[self.submitted % len(ARGUMENTS)]
        sub = Submission(
            key=key,
            task_name="tests.fake",
            spec=spec,
            # Typed arguments: how the gate stores a call's arguments (JSON data, or Celery's
            # repr text when the message holds values JSON has not: dates, bytes, UUIDs).
            args=shown_args or [number],
            kwargs=shown_kwargs or {"n": key},
            options=options,
            not_before=not_before,
            expires=expires,
            attempt=rng.choice([0, 0, 1]),
            job=job,
            concurrency_policy="forbid" if job else "allow",
            pinned_worker=pinned,
            fairness_key=fairness_key,
        )
        label = (
            f"submit {key} {demand} prio={spec.priority} nb={offset(not_before)} "
            f"timeout={timeout} expires={offset(expires)} job={job} pinned={pinned} "
            f"fair={fairness_key}"
        )
        return label, lambda: admission.enqueue(sub)


@pytest.fixture
def listener() -> Iterator[Listener]:
    rec = Listener()
    for signal in signals.BY_KIND.values():
        signal.connect(rec, sender=PoolEvent, weak=False)
    yield rec
    for signal in signals.BY_KIND.values():
        signal.disconnect(rec, sender=PoolEvent)


def run_path(seed: int, fast: bool, settings: Any, rec: Any, listener: Listener) -> list[Step]:
    """Empty the pools tables, then apply the seeded sequence on one path."""
    with connection.cursor() as cursor:
        cursor.execute(
            "TRUNCATE pools_demand, pools_poolevent, pools_queueentry, pools_pool, "
            "pools_workernode "
            "RESTART IDENTITY CASCADE"
        )
    settings.POOLS = {**settings.POOLS, "SQL_FAST_PATH": fast}
    dispatch._scheduled.clear()
    rec.reset()
    listener.take()
    clock = Clock()
    steps: list[Step] = []
    with (
        mock.patch("django.utils.timezone.now", clock),
        mock.patch("pools.core.rates.db_now", clock),
        _real_database_clock_after(),
    ):
        for name, (slots, max_queued) in POOLS.items():
            make_pool(name, slots, max_queued=max_queued, **STRATEGIES[name])
        run = Run(seed, clock)
        for _ in range(STEPS):
            op, fn = run.next_op()
            raised = None
            returned = None
            database_clock(clock.now)
            try:
                returned = summary(fn())
            except PoolError as exc:
                raised = f"{type(exc).__name__}: {exc}"
            steps.append(
                Step(op, raised, returned, bridge_output(rec), listener.take(), snapshot())
            )
    return steps


@contextmanager
def _real_database_clock_after() -> Iterator[None]:
    try:
        yield
    finally:
        database_clock(None)


def database_clock(now: datetime | None) -> None:
    """What the stored functions read as the database clock (``None``: the real one)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT set_config('pools.clock', %s, false)", [now.isoformat() if now else ""]
        )


def first_difference(sql: list[Step], orm: list[Step]) -> str | None:
    for i, (s, o) in enumerate(zip(sql, orm, strict=True)):
        for what in ("op", "raised", "returned", "bridge", "heard", "state"):
            left, right = getattr(s, what), getattr(o, what)
            if left != right:
                if what == "state":
                    left, right = _state_diff(left, right)
                history = "\n".join(f"  {j}: {st.op} -> {st.raised or st.returned}" for j, st in enumerate(sql[max(0, i - 8) : i + 1], start=max(0, i - 8)))  # fmt: skip
                return (
                    f"step {i} ({s.op}): {what} differs\n  sql: {left}\n  orm: {right}\n"
                    f"recent steps (sql):\n{history}"
                )
    return None


def _state_diff(left: dict[str, Any], right: dict[str, Any]) -> tuple[Any, Any]:
    out_l: dict[str, Any] = {}
    out_r: dict[str, Any] = {}
    for part in left:
        if left[part] == right[part]:
            continue
        if isinstance(left[part], dict):
            keys = {
                k
                for k in left[part].keys() | right[part].keys()
                if left[part].get(k) != right[part].get(k)
            }
            out_l[part] = {k: left[part].get(k) for k in sorted(keys)}
            out_r[part] = {k: right[part].get(k) for k in sorted(keys)}
        else:
            out_l[part] = sorted(set(map(str, left[part])) - set(map(str, right[part])))
            out_r[part] = sorted(set(map(str, right[part])) - set(map(str, left[part])))
    return out_l, out_r


@pytest.mark.parametrize("seed", SEEDS)
def test_differential__sql_and_orm_paths_agree_step_by_step(
    seed: int, settings: Settings, recorder: RecordingBridge, listener: Listener
) -> None:
    sql = run_path(seed, True, settings, recorder, listener)
    orm = run_path(seed, False, settings, recorder, listener)
    difference = first_difference(sql, orm)
    assert difference is None, difference
    if seed not in DEFAULT_SEEDS:
        return  # a longer hunt (POOLS_DIFFERENTIAL_SEEDS): agreement is what is checked
    # The default seeds exercise what they are meant to (a weak sequence would prove little).
    ops = [s.op.split()[0] for s in sql]
    raised = {s.raised.split(":")[0] for s in sql if s.raised}
    assert {"submit", "start", "settle", "cancel", "advance"} <= set(ops), ops
    assert {"UnknownPool", "PoolFull", "NotCancellable"} <= raised, raised
    seen = {e["state"] for step in sql for e in step.state["entries"].values()}
    assert {"waiting", "admitted", "running", "succeeded", "cancelled", "expired"} <= seen, seen
    # The strategies were exercised: fair rounds moved on, keys competed in a fair pool,
    # aged places (line_at before the enqueue time) and strategy changes happened.
    assert max(p[-1] for step in sql for p in step.state["pools"].values()) >= 1
    fair_rows = [d for step in sql for d in step.state["demands"] if d[8] is not None]
    assert max(d[6] for d in fair_rows) >= 2, "no key reached a second round"
    fair_keys = {d[8] for d in fair_rows}
    assert len(fair_keys - {""}) >= 2, fair_keys
    assert any(d[7] < d[5] for step in sql for d in step.state["demands"]), "no aged place"
    assert any(".strategy=" in s.op for s in sql), "no strategy change"


def test_differential__self_test_catches_a_planted_difference(
    settings: Settings, recorder: RecordingBridge, listener: Listener
) -> None:
    """The comparison can fail: with the ORM path's ``started`` signals planted without
    their worker, the first start is reported as a difference."""
    from pools.core import events

    sql = run_path(DEFAULT_SEEDS[0], True, settings, recorder, listener)
    real = events.transition

    def planted(kind: EventKind, entries: Any, *, at: datetime, detail: Any = None) -> None:
        real(kind, entries, at=at, detail=None if kind == EventKind.STARTED else detail)

    with mock.patch.object(events, "transition", planted):
        orm = run_path(DEFAULT_SEEDS[0], False, settings, recorder, listener)
    difference = first_difference(sql, orm)
    assert difference is not None and "start" in difference.splitlines()[0], difference
