"""Rate values (issue 17): Celery's notation plus /d, their messages, and where they are read."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
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


# The window of starts (pools.core.rates.start_opens): a start at ``now`` is allowed iff the
# N-th previous start of each rate is at most ``now - (W + margin)``.

_T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _at(seconds: float) -> datetime:
    return _T0 + timedelta(seconds=seconds)


def test_start_opens__fewer_than_n_starts_so_far_allows_now() -> None:
    assert rates.start_opens([(Rate(3, 1.0), None)], _at(0)) is None


def test_start_opens__the_nth_previous_start_old_enough_allows_now() -> None:
    margin = rates.HANDOFF_MARGIN.total_seconds()
    assert rates.start_opens([(Rate(3, 1.0), _at(0))], _at(1 + margin)) is None
    assert rates.start_opens([(Rate(3, 1.0), _at(0))], _at(5)) is None


def test_start_opens__inside_the_window_waits_for_w_plus_the_margin() -> None:
    opens = rates.start_opens([(Rate(3, 1.0), _at(0))], _at(0.5))
    assert opens == _at(1) + rates.HANDOFF_MARGIN


def test_start_opens__just_inside_the_window_with_the_margin_still_waits() -> None:
    margin = rates.HANDOFF_MARGIN.total_seconds()
    now = _at(1 + margin - 1e-6)
    assert rates.start_opens([(Rate(3, 1.0), _at(0))], now) == _at(1 + margin)


def test_start_opens__every_rate_must_have_room_the_latest_opening_wins() -> None:
    marks = [(Rate(5, 1.0), _at(9.5)), (Rate(30, 60.0), _at(0))]
    assert rates.start_opens(marks, _at(10), margin=timedelta(0)) == _at(60)
    marks2: list[tuple[Rate, datetime | None]] = [(Rate(5, 1.0), _at(9.5)), (Rate(30, 60.0), None)]
    assert rates.start_opens(marks2, _at(10), margin=timedelta(0)) == _at(10.5)


def test_start_opens__without_margin_the_boundary_is_exact() -> None:
    assert rates.start_opens([(Rate(2, 1.0), _at(0))], _at(1), margin=timedelta(0)) is None
    assert rates.start_opens([(Rate(2, 1.0), _at(0))], _at(0.999999), margin=timedelta(0))


def test_start_opens__a_ring_of_starts_keeps_n_per_window_plus_margin() -> None:
    """Simulated: starts wanted every 10 ms for 3 s through a 4/s ring. Whatever the
    wish, no window of W + margin holds more than 4 of the starts allowed."""
    from pools.bench.rates import max_in_window

    rate, margin = Rate(4, 1.0), rates.HANDOFF_MARGIN
    ring: list[datetime | None] = [None] * rate.count
    done: list[float] = []
    t = 0.0
    while t < 3.0:
        k = len(done)
        opens = rates.start_opens([(rate, ring[k % rate.count])], _at(t), margin)
        if opens is None:
            ring[k % rate.count] = _at(t)
            done.append(t)
            t += 0.01
        else:
            t = (opens - _T0).total_seconds()
    assert max_in_window(done, 1.0 + margin.total_seconds() - 1e-9)[0] == 4
    assert len(done) >= 9  # three windows of W + margin fit: the limiter keeps up
