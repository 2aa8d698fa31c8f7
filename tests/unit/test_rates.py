"""Rate values (issue 17): Celery's notation plus /d, their messages, and where they are read."""

from __future__ import annotations

from typing import Any

import pytest

from pools import pool_fields
from pools.core import declarations, rates
from pools.core.rates import Rate, parse_rates
from pools.exceptions import PoolConfigurationError
from pools.specs import PoolSpec


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("20/s", (Rate(20, 1.0),)),
        ("100/m", (Rate(100, 60.0),)),
        ("5/h", (Rate(5, 3600.0),)),
        ("100000/d", (Rate(100000, 86400.0),)),
        (" 7 / m ", (Rate(7, 60.0),)),
        ("12", (Rate(12, 1.0),)),  # a bare number means N/s, as in Celery
        (12, (Rate(12, 1.0),)),
        (12.0, (Rate(12, 1.0),)),
        (["10/s", "100000/d"], (Rate(10, 1.0), Rate(100000, 86400.0))),
        ("10/s,100000/d", (Rate(10, 1.0), Rate(100000, 86400.0))),
        (None, ()),
        ("", ()),
        ([], ()),
    ],
)
def test_parse_rates__accepts_celery_notation(value: Any, expected: tuple[Rate, ...]) -> None:
    assert parse_rates(value) == expected


def test_rate__renders_back_in_the_same_notation() -> None:
    assert [str(r) for r in parse_rates(["20/s", "3/m", "4/h", "5/d"])] == [
        "20/s",
        "3/m",
        "4/h",
        "5/d",
    ]
    assert rates.normalize(["10/s", " 100000 /d"]) == "10/s,100000/d"
    assert rates.as_list("10/s,100000/d") == ["10/s", "100000/d"]
    assert Rate(3, 60.0).window.total_seconds() == 60


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("10/x", "'10/x' is not a rate; use N/s, N/m, N/h or N/d"),
        ("ten/s", "'ten/s' is not a rate; use N/s, N/m, N/h or N/d"),
        ("-1/s", "'-1/s' is not a rate"),
        ("0/s", "'0/s' must allow between 1 and 1,000,000 starts per window"),
        ("2000000/d", "must allow between 1 and 1,000,000"),
        (
            0.5,
            "0.5 is not a whole number of starts per second; write the rate with a longer "
            "window instead (e.g. 0.5 per second is '30/m')",
        ),
        (True, "True is not a rate"),
        ({"n": 1}, "is not a rate"),
        ("10/s,", "has an empty rate; separate rates with commas"),
        (["10/s", "1/w"], "'1/w' is not a rate"),
    ],
)
def test_parse_rates__refuses_with_the_fix(value: Any, message: str) -> None:
    with pytest.raises(PoolConfigurationError) as info:
        parse_rates(value, what="POOLS['DEFINITIONS']['x']['rate']")
    assert message in str(info.value)
    assert str(info.value).startswith("POOLS['DEFINITIONS']['x']['rate']: ")
    assert info.value.field == "rate"


def test_definitions__rate_key_in_settings() -> None:
    d = declarations.parse("x", {"slots": 4, "rate": "100/m"})
    assert (d.slots, d.rate) == (4, "100/m")
    d = declarations.parse("x", {"rate": ["10/s", "100000/d"]})
    assert (d.slots, d.rate) == (rates.UNLIMITED_SLOTS, "10/s,100000/d")
    assert declarations.parse("x", {"slots": 1}).rate == ""
    with pytest.raises(PoolConfigurationError) as info:
        declarations.parse("x", {"slots": 1, "rate": "10/x"})
    assert str(info.value) == (
        "POOLS['DEFINITIONS']['x']['rate']: '10/x' is not a rate; use N/s, N/m, N/h or N/d "
        "(e.g. '100/m')."
    )
    with pytest.raises(PoolConfigurationError, match="or a 'rate' alone"):
        declarations.parse("x", {})


def test_definitions__rate_key_in_templates_and_fields() -> None:
    t = declarations.parse_template("tenant:{tenant_id}", {"rate": "5/s"})
    assert (t.slots, t.rate) == (rates.UNLIMITED_SLOTS, "5/s")
    t = declarations.parse_template("tenant:{tenant_id}", {"slots": 2, "rate": ["5/s", "60/m"]})
    assert (t.slots, t.rate) == (2, "5/s,60/m")
    with pytest.raises(PoolConfigurationError, match=r"\['rate'\]: '5/y' is not a rate"):
        declarations.parse_template("tenant:{tenant_id}", {"rate": "5/y"})
    assert pool_fields.check_fields({"rate": ["1/s"]}) == {"rate": "1/s"}
    with pytest.raises(PoolConfigurationError) as info:
        pool_fields.check_fields({"rate": "1/y"})
    assert info.value.field == "rate"


def test_pooled__rate_gives_the_task_its_own_pool() -> None:
    spec = PoolSpec.build(None, rate="20/s")
    assert (spec.demand, spec.rate) == ({}, "20/s")
    capped = spec.with_task_cap("app.tasks.call_partner")
    assert capped.demand == {"task-cap:app.tasks.call_partner": 1}
    assert capped.caps == {"task-cap:app.tasks.call_partner": rates.UNLIMITED_SLOTS}
    assert capped.cap_rates == {"task-cap:app.tasks.call_partner": "20/s"}
    both = PoolSpec.build("api", max_running=3, rate=["1/s", "100/h"]).with_task_cap("t")
    assert both.caps == {"task-cap:t": 3} and both.cap_rates == {"task-cap:t": "1/s,100/h"}
    assert PoolSpec.from_dict({"rate": "5/m"}).rate == "5/m"
    with pytest.raises(PoolConfigurationError, match=r"@pooled\(rate=...\): '20/sec' is not"):
        PoolSpec.build(None, rate="20/sec")
    with pytest.raises(PoolConfigurationError, match="or rate='N/s'"):
        PoolSpec.build(None)


def test_pooled__decorator_checks_the_rate_when_applied() -> None:
    import pools

    with pytest.raises(PoolConfigurationError, match="is not a rate"):
        pools.pooled(rate="fast")
