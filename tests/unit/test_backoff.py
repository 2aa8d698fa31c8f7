"""``pools.Backoff``: its arguments, ``Retry-After`` in both forms, the settings and the
per-task limit (no database)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from django.test import override_settings

import pools
from pools import conf
from pools.core.backoffs import chosen_pools
from pools.exceptions import PoolConfigurationError, PoolError, retry_after_seconds
from pools.specs import PoolSpec

NOW = datetime(2026, 10, 21, 7, 28, tzinfo=UTC)


def test_backoff__is_a_pool_error_with_seconds_and_pools() -> None:
    exc = pools.Backoff(2, pools=["api"])
    assert isinstance(exc, PoolError) and exc.code == "backoff"
    assert (exc.seconds, exc.pools) == (2.0, ("api",))
    assert pools.Backoff(0.5).pools is None
    assert "not a failure" in str(exc)


@pytest.mark.parametrize("seconds", [0, -1, "30", None, True, float("nan")])
def test_backoff__refuses_a_bad_number_of_seconds(seconds: object) -> None:
    with pytest.raises(PoolConfigurationError, match="positive number of seconds"):
        pools.Backoff(seconds)  # type: ignore[arg-type]


def test_backoff__pools_must_be_a_list_of_names() -> None:
    with pytest.raises(PoolConfigurationError, match="list of pool names"):
        pools.Backoff(1, pools="api")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "value,seconds",
    [
        ("120", 120.0),
        (" 7 ", 7.0),
        (45, 45.0),
        ("Wed, 21 Oct 2026 07:30:00 GMT", 120.0),  # an HTTP-date: until then
        ("Wed, 21 Oct 2026 07:27:00 GMT", 30.0),  # in the past: the default
        ("0", 30.0),
        (None, 30.0),
        ("", 30.0),
        ("soon", 30.0),
        ("-5", 30.0),
    ],
)
def test_retry_after__delta_seconds_and_http_date(value: object, seconds: float) -> None:
    assert retry_after_seconds(value, default=30, now=NOW) == seconds  # type: ignore[arg-type]
    got = pools.Backoff.from_retry_after(value, default=30, now=NOW)  # type: ignore[arg-type]
    assert got.seconds == seconds


def test_retry_after__keeps_the_pools() -> None:
    assert pools.Backoff.from_retry_after("5", default=1, pools=["a"]).pools == ("a",)


def test_backoff_limit_exceeded__plain_args_and_a_message_that_says_what_to_do() -> None:
    exc = pools.BackoffLimitExceeded("app.sync", 3)
    assert exc.args == ("app.sync", 3) and exc.code == "backoff_limit_exceeded"
    assert "backed off 3 times" in str(exc) and "MAX_BACKOFFS" in str(exc)


def test_conf__max_backoffs_defaults_to_ten_and_is_checked() -> None:
    assert conf.get().MAX_BACKOFFS == 10
    with override_settings(POOLS={"MAX_BACKOFFS": 0}):
        assert conf.get().MAX_BACKOFFS == 0
    for bad in (-1, 1.5, True, "3"):
        with (
            override_settings(POOLS={"MAX_BACKOFFS": bad}),
            pytest.raises(PoolConfigurationError, match="MAX_BACKOFFS"),
        ):
            conf.get()


def test_spec__max_backoffs_per_task_is_checked() -> None:
    assert PoolSpec.build("p", max_backoffs=3).max_backoffs == 3
    assert PoolSpec.build("p").max_backoffs is None
    with pytest.raises(PoolConfigurationError, match="max_backoffs"):
        PoolSpec.build("p", max_backoffs=-1)


def test_chosen_pools__all_by_default_or_those_named_that_the_entry_asks_for() -> None:
    assert chosen_pools({"db": 1, "api": 1}, None) == ["api", "db"]
    assert chosen_pools({"db": 1, "api": 1}, ["api", "other"]) == ["api"]
    assert chosen_pools({"db": 1, "api": 1}, ["other"]) == ["api", "db"]
