"""The worker's main process keeps a hard-time-limited claim alive while its pool process
runs it (a body stuck in a C call renews nothing itself), and only then."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from pools.celery import received


@dataclass(eq=False)
class FakeJob:
    """billiard's ``ApplyResult``: the limit it enforces."""

    _timeout: float | None = None


@dataclass(eq=False)
class FakeRequest:
    """What the main process reads of Celery's ``Request``."""

    id: str = "t1"
    time_start: float | None = field(default_factory=time.time)
    worker_pid: int | None = field(default_factory=os.getppid)
    time_limits: tuple[float | None, float | None] = (None, None)
    task: Any = None
    _apply_result: Any = None


def task(time_limit: float | None = None, conf_limit: float | None = None) -> Any:
    app = SimpleNamespace(conf=SimpleNamespace(task_time_limit=conf_limit))
    return SimpleNamespace(time_limit=time_limit, app=app)


@pytest.mark.parametrize(
    ("request_limit", "task_limit", "conf_limit", "job_limit", "expected"),
    [
        (None, None, None, None, None),
        (15, None, None, None, 15.0),
        (None, 20, None, None, 20.0),
        (None, None, 25, None, 25.0),
        (15, 20, 25, None, 15.0),  # the request's own limit first, as Celery applies it
        (None, 20, 25, None, 20.0),
        (None, None, None, 40, 40.0),  # billiard's job: the worker's --time-limit too
        (15, None, None, 40, 40.0),
    ],
)
def test_received__hard_time_limit_is_read_as_celery_applies_it(
    request_limit: float | None,
    task_limit: float | None,
    conf_limit: float | None,
    job_limit: float | None,
    expected: float | None,
) -> None:
    job = FakeJob(job_limit)
    req = FakeRequest(
        time_limits=(request_limit, None),
        task=task(task_limit, conf_limit),
        _apply_result=weakref.ref(job),
    )
    assert received.hard_time_limit(req) == expected


def test_received__a_soft_limit_alone_is_no_hard_limit() -> None:
    req = FakeRequest(time_limits=(None, 5), task=task())
    assert received.hard_time_limit(req) is None


def test_received__kept_alive_only_within_the_hard_limit_of_a_live_pool_process() -> None:
    now = time.time()
    limited = task(time_limit=15)
    assert received._until_hard_limit(FakeRequest(time_start=now, task=limited), now + 20)
    # Past the limit and the exit wait: billiard did not end it; the lease lapses as before.
    late = now + 15 + received.EXIT_WAIT_SECONDS + 0.1
    assert not received._until_hard_limit(FakeRequest(time_start=now, task=limited), late)
    assert not received._until_hard_limit(FakeRequest(time_start=now, task=task()), now + 1)
    assert not received._until_hard_limit(FakeRequest(time_start=None, task=limited), now)
    # A body in this very process (threads, solo): its own keeper renews it.
    same = FakeRequest(time_start=now, worker_pid=os.getpid(), task=limited)
    assert not received._until_hard_limit(same, now + 1)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = FakeRequest(time_start=now, worker_pid=gone.pid, task=limited)
    assert not received._until_hard_limit(dead, now + 1)


def test_received__renews_when_half_the_lease_is_left_by_default(settings: Any) -> None:
    base = {k: v for k, v in settings.POOLS.items() if k != "HEARTBEAT_SECONDS"}
    settings.POOLS = {**base, "LEASE_SECONDS": 6.0}
    assert received.renew_within() == 3.0  # a healthy keeper leaves at least 4 s
    settings.POOLS = {**settings.POOLS, "HEARTBEAT_SECONDS": 3.5}
    assert received.renew_within() == 5.25  # passes every 3.5 s: renew early enough
    settings.POOLS = {**settings.POOLS, "HEARTBEAT_SECONDS": 1.0}
    assert received.renew_within() == 3.0


def test_received__a_pass_renews_held_messages_and_hard_limited_running_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not accepted: renewed (unconditionally). Accepted and running in a live pool
    process with a hard limit: renewed if near its end. Without a hard limit, or past it:
    left to its pool process's keeper."""
    from celery.worker import state

    held = FakeRequest(id="held", time_start=None, task=task(time_limit=15))
    stuck = FakeRequest(id="stuck", task=task(time_limit=15))
    free = FakeRequest(id="free", task=task())
    over = FakeRequest(id="over", time_start=time.time() - 100, task=task(time_limit=15))
    calls: list[tuple[str, int]] = []

    def renew(entry: int, token: int) -> float:
        calls.append(("renew", entry))
        return 1.0

    def renew_if_ending(entry: int, token: int, within: float) -> None:
        calls.append(("if_ending", entry))

    monkeypatch.setattr(received.leases, "renew", renew)
    monkeypatch.setattr(received.leases, "renew_if_ending", renew_if_ending)
    monkeypatch.setattr(state, "active_requests", {stuck, free, over})
    monkeypatch.setattr(received, "_received", {})
    for i, r in enumerate([held, stuck, free, over], start=1):
        received._received[r.id] = received.Received(task_id=r.id, entry_id=i, token=1, request=r)
    received.renew_waiting()
    assert sorted(calls) == [("if_ending", 2), ("renew", 1)]
