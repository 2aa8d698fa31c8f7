"""Typed arguments, wherever a call can wait: every call runs once and returns what plain
Celery returns, on real prefork workers, with both admission engines.

The matrix: argument kinds (date, naive and aware datetimes, UUID, Decimal, bytes, all of
them nested in lists and dicts, as positional and keyword arguments) x Celery's serializers
(json, pickle, msgpack, yaml) x the ways an entry is admitted:

* at enqueue (a roomy pool),
* by another worker's settle (a 1-slot pool behind a holder),
* by the sweep (a paused pool, resumed behind admission's back, then ``pools.sweep``),
* by a timed wake-up (``countdown``),
* through a multi-pool demand (its head is decided by the Python pass on the fast path),

plus linked callbacks, ``link_error`` errbacks and chord headers carrying typed arguments.
Each pooled call is compared with the same call of an unpooled twin: the same exception at
send time (a serializer that cannot carry a kind refuses both), or the same text from the
body (values and their types as the body received them). The run log counts one run per
call. A call whose entry is admitted but never published would make its ``get()`` time out.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

import pytest
from celery import chord
from celery.result import AsyncResult
from pytest_django import Settings

from pools.models import Pool, QueueEntry
from pools.states import UNFINISHED_STATES, EntryState
from tests.acceptance.conftest import WORKER_TEST_MARKS, StartWorkers, wait_for
from tests.celery_app import app
from tests.support.factories import make_pool
from tests.testapp import typed_tasks as t

pytestmark = WORKER_TEST_MARKS

SERIALIZERS = ["json", "pickle", "msgpack", "yaml"]
KINDS: dict[str, Any] = {
    "date": date(2026, 12, 5),
    "datetime-naive": datetime(2026, 12, 5, 10, 30, 1, 123456),
    "datetime-utc": datetime(2026, 12, 5, 10, 30, tzinfo=UTC),
    "datetime-offset": datetime(
        2026, 12, 5, 10, 30, tzinfo=timezone(timedelta(hours=5, minutes=30))
    ),
    "uuid": UUID("6a1c3b52-0f7e-4f0e-9d55-2f1b1b7a9c01"),
    "decimal": Decimal("1.10"),
    "bytes": b"\x00\xffpools",
    "nested": [{"at": date(2026, 1, 1), "ids": [UUID(int=7)]}, {"n": [Decimal("2.5"), b"x"]}],
}
#: Typed values of the canvas test, per serializer: what each can carry (the matrix above
#: shows the refusals: msgpack carries bytes only of these kinds, yaml no UUID or Decimal).
CANVAS_VALUES: dict[str, tuple[Any, Any]] = {
    "json": (KINDS["nested"], KINDS["datetime-offset"]),
    "pickle": (KINDS["nested"], KINDS["datetime-offset"]),
    "msgpack": ([{"raw": b"\x00x"}, b"y"], b"\xff"),
}
#: How long any one result may take (the whole matrix is a few hundred no-op calls).
RESULT_TIMEOUT = 90.0


class Outcome:
    """What one call did: the exception at send time, or the body's text / its error."""

    def __init__(self, send: Callable[[], AsyncResult]) -> None:
        self.refused: Exception | None = None
        self.result: AsyncResult | None = None
        try:
            self.result = send()
        except Exception as exc:
            self.refused = exc

    def same_as(self, plain: Outcome) -> bool:
        """Refused as plain Celery refuses (an instance of its exception class: the gate
        may raise a subclass with a clearer message), or the same text from the body."""
        if plain.refused is not None:
            return isinstance(self.refused, type(plain.refused))
        return self.value() == plain.value()

    def value(self) -> str:
        if self.result is None:
            return f"refused: {self.refused!r}"
        try:
            return f"ok: {self.result.get(timeout=RESULT_TIMEOUT, propagate=True)}"
        except Exception as exc:
            if type(exc).__name__ == "TimeoutError":
                raise AssertionError(f"call {self.result.id} never finished") from exc
            return f"failed: {type(exc).__name__}: {exc}"


def _calls(task: Any, serializer: str, **options: Any) -> dict[str, Outcome]:
    def send(value: Any) -> Callable[[], AsyncResult]:
        return lambda: task.apply_async(
            (value, "x"), {"k": value}, serializer=serializer, **options
        )

    return {kind: Outcome(send(value)) for kind, value in KINDS.items()}


@pytest.fixture
def typed_workers(
    celery_workers: StartWorkers,
    settings: Settings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> Path:
    """Two workers x 2 processes on the engine of the test's parameter; the run log."""
    engine, expect_errors = request.param
    fast = engine == "sql"
    settings.POOLS = {**settings.POOLS, "SQL_FAST_PATH": fast}
    runlog = tmp_path / "runs.log"
    runlog.touch()
    monkeypatch.setenv("POOLS_TEST_RUNLOG", str(runlog))
    monkeypatch.setenv("POOLS_TEST_SQL_FAST_PATH", "1" if fast else "0")
    monkeypatch.setenv("POOLS_TEST_SERIALIZERS", ",".join(SERIALIZERS))
    monkeypatch.setenv("C_FORCE_ROOT", "1")  # pickle accepted while running as root (CI)
    for name, slots in t.TYPED_POOLS.items():
        make_pool(name, slots, paused=name == t.PAUSED)
    # Planned task failures are logged at ERROR: only where the test plans them.
    celery_workers(count=2, concurrency=2, allow_errors=expect_errors)
    return runlog


def _wait_in_line(keys: list[str]) -> None:
    in_line = QueueEntry.objects.filter(key__in=keys, state=EntryState.WAITING)
    wait_for(lambda: in_line.count() == len(keys), 30, "the paused pool's entries to wait")


def _runs(runlog: Path) -> Counter[str]:
    return Counter(runlog.read_text().split())


def _same_as_plain(label: str, pooled: dict[str, Outcome], plain: dict[str, Outcome]) -> list[str]:
    return [
        f"{label} {kind}: pooled {pooled[kind].value()!r} != plain {plain[kind].value()!r}"
        for kind in KINDS
        if not pooled[kind].same_as(plain[kind])
    ]


@pytest.mark.parametrize(
    "typed_workers", [("sql", False), ("orm", False)], indirect=True, ids=["sql", "orm"]
)
def test_typed_arguments__every_way_of_admission_runs_each_call_once_as_plain_celery_does(
    typed_workers: Path,
) -> None:
    runlog = typed_workers
    differences: list[str] = []
    pooled_ids: list[str] = []
    sent_kinds: Counter[str] = Counter()
    for serializer in SERIALIZERS:
        plain = _calls(t.plain_echo, serializer)
        # Admitted at enqueue.
        ways = {"enqueue": _calls(t.free_echo, serializer)}
        # Admitted by another worker's settle: the line waits behind a holder.
        holder = t.line_holder.delay(1.0)
        ways["settle"] = _calls(t.line_echo, serializer)
        # Admitted by a timed wake-up.
        ways["wake-up"] = _calls(t.due_echo, serializer, countdown=1)
        # A multi-pool demand (1 slot in one of its pools: one at a time).
        ways["multi-pool"] = _calls(t.multi_echo, serializer)
        # Admitted by the sweep: the pool is resumed without an admission pass.
        ways["sweep"] = _calls(t.paused_echo, serializer)
        waiting = [o.result.id for o in ways["sweep"].values() if o.result is not None]
        _wait_in_line(waiting)
        Pool.objects.filter(name=t.PAUSED).update(paused=False)  # a test device: see above
        app.send_task("pools.sweep")
        for way, outcomes in ways.items():
            differences += _same_as_plain(f"{serializer} {way}", outcomes, plain)
            pooled_ids += [o.result.id for o in outcomes.values() if o.result is not None]
            sent_kinds.update(k for k, o in outcomes.items() if o.result is not None)
        assert holder.get(timeout=RESULT_TIMEOUT) == "[float:1.0] {}"
        Pool.objects.filter(name=t.PAUSED).update(paused=True)
    assert not differences, "\n".join(differences)
    # Every serializer carried something, and every kind went through at least one.
    assert set(sent_kinds) == set(KINDS), sent_kinds
    runs = _runs(runlog)
    twice = {i: n for i, n in runs.items() if i in pooled_ids and n != 1}
    assert not twice, f"calls that did not run exactly once: {twice}"
    assert all(runs[i] == 1 for i in pooled_ids), "a call never ran"
    # Results are stored before the claim settles: give the last settles a moment.
    wait_for(
        lambda: not QueueEntry.objects.filter(state__in=UNFINISHED_STATES).exists(),
        30,
        "every entry to finish",
    )


@pytest.mark.parametrize(
    "typed_workers", [("sql", True), ("orm", True)], indirect=True, ids=["sql", "orm"]
)
def test_typed_arguments__callbacks_errbacks_and_chord_headers_as_plain_celery(
    typed_workers: Path,
) -> None:
    runlog = typed_workers
    differences: list[str] = []
    pooled_ids: list[str] = []
    for serializer in SERIALIZERS:
        if serializer == "yaml":
            continue  # plain Celery cannot send a signature (link, chord body) as yaml
        value, when = CANVAS_VALUES[serializer]
        outcomes: dict[str, tuple[Any, ...]] = {}
        for side, echo, line, fail, errback, collect in (
            ("plain", t.plain_echo, t.plain_echo, t.plain_fail, t.plain_errback, t.plain_collect),
            ("pooled", t.free_echo, t.line_echo, t.pooled_fail, t.pooled_errback, t.pooled_collect),
        ):
            # A linked callback with typed arguments of its own.
            link_id, errback_id = str(uuid4()), str(uuid4())
            parent = echo.apply_async(
                (value,),
                serializer=serializer,
                link=line.s(when, k=value).set(serializer=serializer, task_id=link_id),
            )
            # An errback (old style: the failed task's id, then its own keyword arguments).
            failed = fail.apply_async(
                (when,),
                serializer=serializer,
                link_error=errback.s(k=value, at=when).set(
                    serializer=serializer, task_id=errback_id
                ),
            )
            # A chord whose header carries typed arguments.
            header = [echo.s(v, k=v).set(serializer=serializer) for v in (value, when)]
            body = collect.s(when).set(serializer=serializer)
            joined = chord(header)(body)
            parent.get(timeout=RESULT_TIMEOUT)
            with pytest.raises(ValueError):
                failed.get(timeout=RESULT_TIMEOUT)
            outcomes[side] = (
                AsyncResult(link_id).get(timeout=RESULT_TIMEOUT),
                AsyncResult(errback_id).get(timeout=RESULT_TIMEOUT),
                joined.get(timeout=RESULT_TIMEOUT),
            )
            if side == "pooled":
                pooled_ids += [parent.id, failed.id, link_id, errback_id, joined.id]
        if outcomes["plain"] != outcomes["pooled"]:
            differences.append(f"{serializer}: {outcomes['pooled']} != {outcomes['plain']}")
    assert not differences, "\n".join(differences)
    runs = _runs(runlog)
    assert all(runs[i] == 1 for i in pooled_ids), {i: runs[i] for i in pooled_ids}
    # The pooled callbacks went through the pools (they are entries, not direct calls).
    assert QueueEntry.objects.filter(key__in=pooled_ids).count() == len(pooled_ids)
    assert os.path.getsize(runlog) > 0
