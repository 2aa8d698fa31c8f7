"""The POOLS settings object: defaults, validation, reload on override_settings."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import override_settings

from pools import conf
from pools.checks import check_settings
from pools.exceptions import PoolConfigurationError


def test_defaults() -> None:
    with override_settings(POOLS={}):
        s = conf.get()
        assert s.LEASE_SECONDS == 30.0
        assert s.heartbeat_seconds == 10.0
        assert s.DEFINITIONS == {} and s.TASKS == {}


def test_reload_on_override_settings() -> None:
    with override_settings(POOLS={"LEASE_SECONDS": 9}):
        assert conf.get().LEASE_SECONDS == 9
    assert conf.get().LEASE_SECONDS == 30.0


@pytest.mark.parametrize(
    ("pools", "match"),
    [
        ({"LEASE": 3}, "Unknown key"),
        ({"LEASE_SECONDS": "30"}, "positive number"),
        ({"LEASE_SECONDS": 0}, "positive number"),
        ({"DEFINITIONS": ["warehouse"]}, "must be a dict"),
        ([], "must be a dict"),
    ],
)
def test_invalid_settings__clear_error(pools: object, match: str) -> None:
    with override_settings(POOLS=pools), pytest.raises(PoolConfigurationError, match=match):
        conf.get()


@pytest.mark.parametrize(
    ("pools", "check_id", "match"),
    [
        ({"LEASE_SECONDS": -1}, "pools.E001", "positive number"),
        ({"DEFINITIONS": {"bad name": {"slots": 1}}}, "pools.E002", "Invalid pool name"),
        ({"DEFINITIONS": {"w": {"slots": 0}}}, "pools.E002", "positive integer"),
        ({"DEFINITIONS": {"w": {"slots": 1, "size": 2}}}, "pools.E002", "unknown key"),
        ({"DEFINITIONS": {"w": {}}}, "pools.E002", "needs 'slots'"),
        ({"TASKS": {"t": {"pool": "w"}}}, "pools.E003", "expected keys"),
        ({"LEASE_SECONDS": 3, "HEARTBEAT_SECONDS": 5}, "pools.E004", "shorter"),
        ({"LEASE_SECONDS": 6, "FENCE_MARGIN_SECONDS": 5}, "pools.E005", "HEARTBEAT_SECONDS"),
        (
            {"FENCE_MARGIN_SECONDS": 0.5, "REQUEUE_GRACE_SECONDS": 0, "CLOCK_SKEW_SECONDS": 1},
            "pools.E005",
            "re-admitted elsewhere",
        ),
        ({"REQUEUE_GRACE_SECONDS": -1}, "pools.E001", "0 or more"),
        ({"FENCE_MARGIN_SECONDS": 0}, "pools.E001", "positive number"),
        ({"TEMPLATES": {"tenant": {"slots": 1}}}, "pools.E030", "needs at least one"),
        ({"TEMPLATES": {"t:{k}": {}}}, "pools.E030", "needs 'slots'"),
        ({"TEMPLATES": {"t:{k}": {"slots": 0}}}, "pools.E030", "positive integer"),
        ({"TEMPLATES": {"t:{k}": {"slots": 1, "strategy": "rr"}}}, "pools.E030", "must be one"),
        (
            {"TEMPLATES": {"t:{k}": {"slots": 1, "strategy": "fair", "aging_seconds": 5}}},
            "pools.E030",
            "aging_seconds applies",
        ),
        ({"TASKS": {"t": {"pools": "t:{k}"}}}, "pools.E031", "has no template"),
        ({"TEMPLATE_IDLE_SECONDS": 0}, "pools.E001", "positive number"),
        ({"DEFAULT_POOL": ["default"]}, "pools.E001", "must be None or a dict"),
        ({"DEFAULT_POOL": {"name": "default"}}, "pools.E032", "needs 'slots'"),
        ({"DEFAULT_POOL": {"slots": 4, "queues": "celery"}}, "pools.E032", "list of queue"),
        ({"DEFAULT_POOL": {"slots": 4, "queue": ["c"]}}, "pools.E032", "unknown key"),
    ],
)
def test_system_checks__report_bad_definitions(
    pools: dict[str, Any], check_id: str, match: str
) -> None:
    with override_settings(POOLS=pools):
        errors = check_settings()
    assert [e.id for e in errors] == [check_id]
    assert match in errors[0].msg
