"""Debounce (docs/howto/debounce.md): calls with the same key collapse into one waiting
entry that runs once, after the key has been quiet, with the last call's arguments.

Through the gate on both admission paths (PostgreSQL: the stored-function engine hands a
debounced submit to the ORM engine), concurrent callers (threads) on every database, and
the result of each collapsed call.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from celery import current_app
from django.db import connection
from django.utils import timezone

from pools import pooled
from pools.celery import results
from pools.core import admission, explain
from pools.core.records import DEBOUNCED_OPTION, Submission
from pools.exceptions import PoolConfigurationError
from pools.models import DELAYED, Demand, EntryState, Pool, QueueEntry
from pools.specs import PoolSpec
from tests.support.api import API_APPS, client_for, url
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool
from tests.testapp import tasks

# celery-types' apply_async takes no **options (pool_options).
add: Any = tasks.add

pytestmark = pytest.mark.django_db(transaction=True, available_apps=API_APPS)

KEY = "tenant-7"
QUIET = {"debounce": 30, "idempotency_key": KEY}


@pytest.fixture
def paths(admission_path: str, recorder: RecordingBridge) -> RecordingBridge:
    """Both admission paths (PostgreSQL runs each test on the SQL and the ORM path)."""
    return recorder


def entries() -> list[QueueEntry]:
    return list(QueueEntry.objects.order_by("queue_id"))


def quiet_now(entry: QueueEntry) -> None:
    """Let the entry's quiet time end (its not-before moves into the past), then a pass."""
    past = timezone.now() - timedelta(seconds=1)
    QueueEntry.objects.filter(pk=entry.pk).update(not_before=past)
    Demand.objects.filter(entry_id=entry.pk).update(enqueued_at=past)
    Pool.objects.filter(name__in=list(entry.demand)).update(next_due_at=past)
    admission.admit(entry.demand)


def test_burst__one_entry_with_the_last_arguments_and_one_run(paths: RecordingBridge) -> None:
    make_pool("warehouse", 1)
    ids = [str(add.apply_async((i, i), pool_options=QUIET).id) for i in range(1, 4)]
    assert len(set(ids)) == 3  # each caller keeps its own task id
    (entry,) = entries()
    assert entry.state == EntryState.WAITING
    assert entry.key == ids[-1]  # the run is the last call
    assert entry.args == [3, 3]  # ... with its arguments
    assert entry.options[DEBOUNCED_OPTION] == ids[:-1]  # the calls it collapsed
    assert entry.debounce_key == KEY
    assert paths.admissions == []  # nothing runs while the key is not quiet
    quiet_now(entry)
    (adm,) = paths.admissions
    assert (adm.key, adm.args) == (ids[-1], [3, 3])
    assert adm.options[DEBOUNCED_OPTION] == ids[:-1]


def test_each_call_pushes_the_start(paths: RecordingBridge) -> None:
    make_pool("warehouse", 1)
    add.apply_async((1, 1), pool_options=QUIET)
    (first,) = entries()
    before = timezone.now()
    add.apply_async((2, 2), pool_options=QUIET)
    (pushed,) = entries()
    assert first.not_before is not None and pushed.not_before is not None
    assert pushed.not_before >= before + timedelta(seconds=30) > first.not_before
    rows = list(Demand.objects.filter(entry_id=pushed.pk))
    assert [(r.state, r.enqueued_at) for r in rows] == [(DELAYED, pushed.not_before)]
    assert pushed.enqueued_at == first.enqueued_at  # it has waited since the first call


def test_other_keys_and_undebounced_calls_do_not_collapse(paths: RecordingBridge) -> None:
    make_pool("warehouse", 1)
    add.apply_async((1, 1), pool_options=QUIET)
    add.apply_async((2, 2), pool_options={**QUIET, "idempotency_key": "tenant-8"})
    add.apply_async((3, 3))
    assert [e.args for e in entries()] == [[1, 1], [2, 2], [3, 3]]


def test_admitted_entry_is_not_changed__a_new_window_starts(paths: RecordingBridge) -> None:
    make_pool("warehouse", 2)
    first_id = str(add.apply_async((1, 1), pool_options=QUIET).id)
    (first,) = entries()
    quiet_now(first)
    assert paths.keys() == [first_id]
    second_id = str(add.apply_async((2, 2), pool_options=QUIET).id)
    third_id = str(add.apply_async((3, 3), pool_options=QUIET).id)
    old, new = entries()
    assert (old.key, old.args, old.state) == (first_id, [1, 1], EntryState.ADMITTED)
    assert DEBOUNCED_OPTION not in old.options or old.options[DEBOUNCED_OPTION] == []
    assert (new.key, new.args, new.state) == (third_id, [3, 3], EntryState.WAITING)
    assert new.options[DEBOUNCED_OPTION] == [second_id]
    assert paths.keys() == [first_id]


def test_explain_and_rest__waits_for_quiet_until(paths: RecordingBridge) -> None:
    make_pool("warehouse", 1)
    add.apply_async((1, 1), pool_options=QUIET)
    last = str(add.apply_async((2, 2), pool_options=QUIET).id)
    got = explain.explain_key(last)
    (place,) = got.places
    assert place.blocked_by == "not_before"
    assert "waits for quiet until" in place.message and KEY in place.message
    assert place.detail["debounce_key"] == KEY
    assert place.detail["quiet_seconds"] == 30
    assert place.detail["collapsed_calls"] == 1
    response = client_for("pools.view_pool").get(url(f"entries/{last}/"))
    assert response.status_code == 200, response.content
    assert response.json()["debounce_key"] == KEY
    (shown,) = response.json()["pools"]
    assert "waits for quiet until" in shown["message"]
    assert shown["detail"]["debounce_key"] == KEY


def test_cancelled_run__every_collapsed_call_is_reported(paths: RecordingBridge) -> None:
    """Revoking the run (its task id is the last call's) ends every collapsed call."""
    make_pool("warehouse", 1)
    ids = [str(add.apply_async((i, i), pool_options=QUIET).id) for i in range(3)]
    assert admission.cancel_if_waiting(ids[0], reason="revoked") is False  # not the run's id
    assert admission.cancel_if_waiting(ids[-1], reason="revoked") is True
    (finished,) = paths.finished
    assert finished.key == ids[-1]
    assert results.collapsed_ids(finished.options) == ids[:-1]


def test_result_of_the_run__stored_under_each_collapsed_call() -> None:
    """What the worker does after the run (``task_postrun``): every id gets the result."""
    results.mirror("run", ["a-1", "a-2", "run"], "SUCCESS", 42)
    backend = current_app.backend
    assert [backend.get_task_meta(k)["result"] for k in ("a-1", "a-2")] == [42, 42]
    assert backend.get_task_meta("run")["status"] == "PENDING"  # the worker stores its own
    results.mirror("run", ["b-1"], "RETRY", None)  # not final: nothing stored
    assert backend.get_task_meta("b-1")["status"] == "PENDING"
    failure = ValueError("partner said no")
    results.mirror("run", ["c-1"], "FAILURE", failure)
    meta = backend.get_task_meta("c-1")
    assert meta["status"] == "FAILURE"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"debounce": -1, "idempotency_key": KEY}, "debounce must be a positive number"),
        ({"debounce": 0, "idempotency_key": KEY}, "debounce must be a positive number"),
        ({"debounce": "5", "idempotency_key": KEY}, "debounce must be a positive number"),
        ({"debounce": 5}, "debounce needs a key"),
        ({**QUIET, "concurrency_policy": "skip"}, "cannot be combined with concurrency_policy"),
    ],
)
def test_bad_debounce_options__refused_at_the_call_nothing_written(
    paths: RecordingBridge, options: dict[str, Any], message: str
) -> None:
    make_pool("warehouse", 1)
    add.apply_async((1, 1), pool_options=QUIET)
    with pytest.raises(PoolConfigurationError, match=message):
        add.apply_async((9, 9), pool_options=options)
    (entry,) = entries()  # the waiting call is untouched
    assert entry.args == [1, 1]


def test_bad_decorator_debounce__refused_at_decoration() -> None:
    with pytest.raises(PoolConfigurationError, match="needs debounce_key"):
        pooled("warehouse", debounce=5)
    with pytest.raises(PoolConfigurationError, match="needs debounce="):
        pooled("warehouse", debounce_key=lambda *a, **k: "k")
    with pytest.raises(PoolConfigurationError, match="cannot take idempotency_key"):
        pooled("warehouse", debounce=5, debounce_key=lambda *a, **k: "k", idempotency_key="x")
    with pytest.raises(PoolConfigurationError, match="debounce must be a positive"):
        pooled("warehouse", debounce=-2, debounce_key=lambda *a, **k: "k")
    with pytest.raises(PoolConfigurationError, match="cannot be combined"):
        pooled("warehouse", debounce=5, debounce_key=str, concurrency_policy="forbid")


def test_decorator_key_function(paths: RecordingBridge) -> None:
    make_pool("warehouse", 1)
    spec = PoolSpec.build("warehouse", debounce=10, debounce_key=lambda x, y: f"user-{x}")
    for args in ((1, 1), (2, 1), (1, 2)):
        sub = Submission(
            key=f"t-{args}",
            task_name="tests.add",
            spec=spec,
            args=list(args),
            debounce=spec.debounce,
            debounce_key=f"user-{args[0]}",
        )
        admission.enqueue(sub)
    assert [(e.debounce_key, e.args) for e in entries()] == [("user-1", [1, 2]), ("user-2", [2, 1])]


THREADS = 8


def test_concurrent_callers__collapse_into_one_entry(paths: RecordingBridge) -> None:
    """Threads, each on its own connection, submit the same key at once: one entry."""
    make_pool("warehouse", 1)
    spec = PoolSpec.build("warehouse")
    barrier = threading.Barrier(THREADS)
    errors: list[str] = []

    def call(i: int) -> None:
        try:
            sub = Submission(
                key=f"race-{i}",
                task_name="tests.add",
                spec=spec,
                args=[i, i],
                debounce=30,
                debounce_key=KEY,
            )
            barrier.wait(timeout=60)
            for _ in range(20):  # SQLite: a writer that found the file locked tries again
                try:
                    admission.enqueue(sub)
                    return
                except Exception as exc:
                    if connection.vendor != "sqlite" or "locked" not in str(exc.__cause__ or exc):
                        raise
        except Exception as exc:
            errors.append(repr(exc))
        finally:
            connection.close()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    (entry,) = entries()
    collapsed = entry.options[DEBOUNCED_OPTION]
    assert sorted([*collapsed, entry.key]) == sorted(f"race-{i}" for i in range(THREADS))
    assert entry.args == [int(entry.key.split("-")[1])] * 2  # the last call's arguments
    assert Demand.objects.filter(entry=entry).count() == 1
