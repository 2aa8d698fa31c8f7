"""A worker rides out a short database outage when it starts a claim (pools.celery.worker)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from celery.exceptions import Ignore

from pools.celery import worker
from pools.core.leases import Claim
from pools.exceptions import PoolUnavailable

CLAIM = Claim(entry_id=7, token=3, demand={"p": 1}, lease_expires_at=datetime.now(UTC))


@pytest.fixture
def starts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Replace leases.start with a scripted one; no sleeping, no real connection."""
    calls: list[int] = []
    monkeypatch.setattr(worker.time, "sleep", lambda seconds: None)
    monkeypatch.setattr(worker.connection, "close", lambda: None)
    return calls


def test_start_claim__retries_while_pool_state_is_unavailable(
    monkeypatch: pytest.MonkeyPatch, starts: list[int]
) -> None:
    def start(entry_id: int, token: int, *, worker: str) -> Any:
        starts.append(entry_id)
        if len(starts) < 3:
            raise PoolUnavailable("pool state is unavailable (restarting)")
        return CLAIM

    monkeypatch.setattr(worker.leases, "start", start)
    assert worker.start_claim(7, 3, worker="w1", what="t[1]") is CLAIM
    assert len(starts) == 3


def test_start_claim__gives_up_without_a_result_when_the_outage_lasts(
    monkeypatch: pytest.MonkeyPatch, starts: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    clock = iter(range(0, 10_000, 5))  # every look at the clock is 5 s later

    def start(entry_id: int, token: int, *, worker: str) -> Any:
        starts.append(entry_id)
        raise PoolUnavailable("pool state is unavailable (down)")

    monkeypatch.setattr(worker.leases, "start", start)
    monkeypatch.setattr(worker.time, "monotonic", lambda: float(next(clock)))
    with pytest.raises(Ignore):
        worker.start_claim(7, 3, worker="w1", what="t[1]")
    assert starts, "it tried at least once"
    assert "runs again once its lease lapses" in caplog.text


def test_start_claim__a_rated_delivery_confirms_its_start_an_unrated_one_does_not(
    monkeypatch: pytest.MonkeyPatch, starts: list[int]
) -> None:
    """Only a message marked ``pools_rated`` takes the rated start (the pool's lock); the
    decision is the header's alone, no query."""
    called: list[str] = []

    def plain(entry_id: int, token: int, *, worker: str) -> Any:
        called.append("start")
        return CLAIM

    def rated(entry_id: int, token: int, *, worker: str) -> Any:
        called.append("start_rated")
        return CLAIM

    monkeypatch.setattr(worker.leases, "start", plain)
    monkeypatch.setattr(worker.leases, "start_rated", rated)
    assert worker.start_claim(7, 3, worker="w1", what="t[1]") is CLAIM
    assert worker.start_claim(7, 3, worker="w1", what="t[1]", rated=True) is CLAIM
    assert called == ["start", "start_rated"]


def test_rated_of__reads_the_header() -> None:
    from types import SimpleNamespace

    from pools.celery import messages

    assert messages.rated_of(SimpleNamespace(headers={messages.RATED_HEADER: 1}))
    assert not messages.rated_of(SimpleNamespace(headers={}))
    assert not messages.rated_of(None)
