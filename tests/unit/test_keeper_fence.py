"""The keeper fences by its own clock: a hanging renewal does not delay the interrupt.

A silent network partition (no RST, no FIN) makes a renewal call hang instead of fail. The
watchdog thread interrupts the body once its fence time (lease end minus the fence margin,
on the monotonic clock) passes without a confirmed renewal, while the renewal thread is
still stuck in the call. The sabotage twin turns the watchdog off and shows the same body
then keeps running: the first test could not pass without it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pytest_django import Settings

from pools import conf
from pools.celery import keeper as keeper_module
from pools.celery.keeper import LeaseKeeper, body_running
from pools.core.leases import Claim
from pools.exceptions import LeaseLost

LEASE = 1.5
#: Generous: the body waits this long for LeaseLost (never a timed pass/fail bound).
WAIT = 30.0


def claim(entry_id: int, seconds: float = LEASE) -> Claim:
    until = datetime.now(UTC) + timedelta(seconds=seconds)
    return Claim(entry_id=entry_id, token=1, demand={"a": 1}, lease_expires_at=until)


@pytest.fixture
def short(settings: Settings) -> None:
    settings.POOLS = {**settings.POOLS, "LEASE_SECONDS": LEASE, "HEARTBEAT_SECONDS": 0.3}


@pytest.fixture
def hanging_renewal(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """``leases.renew`` blocks until the event is set, as on a black-holed socket."""
    release = threading.Event()
    calls: list[float] = []

    def renew(entry_id: int, token: int, **started: Any) -> Any:
        calls.append(time.monotonic())
        release.wait(WAIT * 2)
        return datetime.now(UTC) + timedelta(seconds=LEASE)  # after the test: no more losses

    monkeypatch.setattr(keeper_module.leases, "renew", renew)
    monkeypatch.setattr(keeper_module, "_reset_connection", lambda: None)
    yield release
    release.set()


@pytest.fixture
def keeper() -> Iterator[LeaseKeeper]:
    k = LeaseKeeper()
    yield k
    k.stop(timeout=1)


def run_body(k: LeaseKeeper, c: Claim) -> tuple[str, float]:
    """A body in a thread of its own, holding ``c``: how it ended, and when (monotonic)."""
    outcome: list[tuple[str, float]] = []

    def body() -> None:
        try:
            with body_running():
                k.hold(c)
                end = time.monotonic() + WAIT
                while time.monotonic() < end:
                    time.sleep(0.01)
            outcome.append(("finished", time.monotonic()))
        except LeaseLost:
            outcome.append(("interrupted", time.monotonic()))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(WAIT + 10)
    assert outcome, "the body thread did not end"
    return outcome[0]


def test_keeper__hanging_renewal_is_fenced_by_the_local_clock(
    short: None, hanging_renewal: threading.Event, keeper: LeaseKeeper
) -> None:
    c = claim(1)
    how, _ = run_body(keeper, c)
    assert how == "interrupted"
    assert keeper.is_lost(1)
    # The renewal call had not returned: the fence did not wait for it.
    assert not hanging_renewal.is_set()
    assert keeper._thread is not None and keeper._thread.is_alive()


def test_keeper__without_the_watchdog_a_hanging_renewal_never_fences(
    short: None,
    hanging_renewal: threading.Event,
    keeper: LeaseKeeper,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sabotage twin: no watchdog, and the body outlives its lease (the reported bug)."""
    monkeypatch.setattr(keeper, "fence_overdue", lambda now=None: 0)
    monkeypatch.setattr(f"{__name__}.WAIT", 3 * LEASE)
    how, _ = run_body(keeper, claim(2))
    assert how == "finished"
    assert not keeper.is_lost(2)


def test_fence_overdue__only_past_the_fence_time(
    short: None, keeper: LeaseKeeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    margin = conf.get().fence_margin_seconds
    interrupted: list[int] = []
    monkeypatch.setattr(keeper_module, "_interrupt", interrupted.append)
    monkeypatch.setattr(keeper, "_ensure_thread", lambda: None)
    keeper.hold(claim(3, seconds=LEASE))
    held = keeper._held[3]
    assert held.fence_at == pytest.approx(time.monotonic() + LEASE - margin, abs=0.5)
    assert keeper.fence_overdue(now=held.fence_at - 0.01) == 0
    assert not keeper.is_lost(3)
    assert keeper.fence_overdue(now=held.fence_at) == 1
    assert keeper.is_lost(3)
    assert interrupted.count(threading.get_ident()) == 1
    assert keeper.fence_overdue(now=held.fence_at + 10) == 0  # lost once


def test_renewal__a_confirmed_renewal_moves_the_fence_from_when_it_was_sent(
    short: None, keeper: LeaseKeeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(keeper, "_ensure_thread", lambda: None)
    sent: list[float] = []

    def renew(entry_id: int, token: int, **started: Any) -> datetime:
        sent.append(time.monotonic())
        time.sleep(0.2)  # a slow call: the fence counts from before it, not after
        return datetime.now(UTC) + timedelta(seconds=LEASE)

    monkeypatch.setattr(keeper_module.leases, "renew", renew)
    keeper.hold(claim(4, seconds=0.5))  # a start's lease shorter than LEASE_SECONDS
    before = keeper._held[4].fence_at
    keeper.renew_all()
    after = keeper._held[4].fence_at
    margin = conf.get().fence_margin_seconds
    assert after == pytest.approx(sent[0] + LEASE - margin, abs=0.05)  # sent just before
    assert after > before


def test_timing_rule__defaults_hold_and_violations_are_named(settings: Settings) -> None:
    assert conf.get().timing_violation() is None
    settings.POOLS = {**settings.POOLS, "LEASE_SECONDS": 6.0, "FENCE_MARGIN_SECONDS": 5.0}
    assert "HEARTBEAT_SECONDS" in (conf.get().timing_violation() or "")
    settings.POOLS = {**settings.POOLS, "FENCE_MARGIN_SECONDS": None, "CLOCK_SKEW_SECONDS": 2.0}
    assert conf.get().timing_violation() is None
    settings.POOLS = {
        **settings.POOLS,
        "FENCE_MARGIN_SECONDS": 0.1,
        "REQUEUE_GRACE_SECONDS": 0.0,
        "CLOCK_SKEW_SECONDS": 2.0,
    }
    assert "REQUEUE_GRACE_SECONDS" in (conf.get().timing_violation() or "")
