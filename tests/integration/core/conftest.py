"""Fixtures of the core integration tests."""

from __future__ import annotations

import pytest

from pools.core import rated_pools


@pytest.fixture(autouse=True)
def _rated_pools_read_once(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests that count a call's queries count its own work: the PostgreSQL engine's
    admissions re-read which pools have a rate at most once a second per process
    (:data:`pools.core.rated_pools.TTL`), a query that falls in a counted call only when the
    set-up before it took longer than that (a backlog of 3,000 entries on a busy machine)."""
    if "django_assert_num_queries" in request.fixturenames:
        monkeypatch.setattr(rated_pools, "TTL", float("inf"))
