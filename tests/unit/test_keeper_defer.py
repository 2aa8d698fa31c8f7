"""Deferred settlements: kept through an outage, logged once per pool and outage."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from pools.celery import keeper as keeper_module
from pools.celery.keeper import LeaseKeeper
from pools.core.leases import Claim


def claim(entry_id: int, pools: dict[str, int]) -> Claim:
    lease = datetime.now(UTC) + timedelta(seconds=30)
    return Claim(entry_id=entry_id, token=1, demand=pools, lease_expires_at=lease)


@pytest.fixture
def keeper(monkeypatch: pytest.MonkeyPatch) -> LeaseKeeper:
    k = LeaseKeeper()
    monkeypatch.setattr(k, "_ensure_thread", lambda: None)
    monkeypatch.setattr(keeper_module, "_reset_connection", lambda: None)
    return k


def deferred_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "retry settlement deferred" in r.getMessage()]


def test_defer_settle__one_line_per_pool_and_outage(
    keeper: LeaseKeeper, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    written: list[int] = []
    down = True

    def settle(entry_id: int, token: int, outcome: str, **kwargs: Any) -> None:
        if down:
            raise OSError("database unreachable")
        written.append(entry_id)

    monkeypatch.setattr(keeper_module.admission, "settle", settle)
    until = datetime.now(UTC) + timedelta(seconds=30)
    keeper.defer_settle(claim(1, {"a": 1}), "succeeded", until)
    keeper.defer_settle(claim(2, {"a": 1, "b": 1}), "succeeded", until)
    keeper.retry_settles()  # still down: kept, nothing logged again
    assert deferred_lines(caplog) == [
        "pool a: retry settlement deferred",
        "pool b: retry settlement deferred",
    ]
    assert written == []

    down = False
    keeper.retry_settles()
    assert written == [1, 2]

    caplog.clear()
    down = True
    keeper.defer_settle(claim(3, {"a": 1}), "failed", until)  # a new outage: logged again
    assert deferred_lines(caplog) == ["pool a: retry settlement deferred"]


def test_defer_settle__dropped_once_the_lease_has_lapsed(
    keeper: LeaseKeeper, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    written: list[int] = []
    monkeypatch.setattr(
        keeper_module.admission, "settle", lambda entry_id, *a, **k: written.append(entry_id)
    )
    keeper.defer_settle(claim(4, {"a": 1}), "succeeded", datetime.now(UTC) - timedelta(seconds=1))
    keeper.retry_settles()
    assert written == []
    assert "it will run again" in caplog.text
