"""Run budget values: ``pool_options={"budget": ...}``, ``limit_run(budget=...)``."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest

from pools.celery import caps
from pools.exceptions import BudgetExceeded, PoolConfigurationError
from pools.specs import Budget, PoolSpec


def test_budget__any_subset_of_the_three_limits() -> None:
    b = Budget.from_mapping({"cost": 10, "tokens": 5000, "seconds": 600})
    assert (b.cost, b.tokens, b.seconds) == (10.0, 5000, 600.0)
    assert Budget.from_mapping({"tokens": 7, "cost": None}).limits() == {"tokens": 7}
    assert Budget.from_mapping(b) is b


@pytest.mark.parametrize(
    "raw,match",
    [
        ({}, "one or more of"),
        ("10", "one or more of"),
        ({"dollars": 1}, r"Unknown budget key\(s\) \['dollars'\]"),
        ({"tokens": 1.5}, "positive integer"),
        ({"tokens": True}, "positive integer"),
        ({"cost": 0}, "positive number"),
        ({"seconds": -1}, "positive number"),
        ({"cost": None}, "at least one limit"),
    ],
)
def test_budget__bad_values_are_refused_with_the_fix(raw: Any, match: str) -> None:
    with pytest.raises(PoolConfigurationError, match=match):
        Budget.from_mapping(raw)


def test_pool_options__budget_is_a_call_option() -> None:
    spec = PoolSpec.build("p").with_call_options({"budget": {"cost": 3}, "priority": 2})
    assert spec.budget == Budget(cost=3.0) and spec.priority == 2
    with pytest.raises(PoolConfigurationError, match="positive number"):
        PoolSpec.build("p").with_call_options({"budget": {"cost": "x"}})


def test_budget_exceeded__message_names_the_budget_and_amounts_and_pickles_as_data() -> None:
    exc = BudgetExceeded("run-1", "tokens", 5000, 5012)
    assert str(exc) == (
        "Run 'run-1' has spent its tokens budget: 5012 of 5000 tokens. No further task of "
        "this run is admitted; start a new run, or give this work a larger budget."
    )
    assert exc.args == ("run-1", "tokens", 5000, 5012) and exc.code == "budget_exceeded"
    again = BudgetExceeded(*exc.args)
    assert str(again) == str(exc)


def test_limit_run__opens_the_budget_then_applies_with_the_runs_id() -> None:
    signature = mock.Mock(options={})
    with (
        mock.patch.object(caps.budgets, "open_run") as open_run,
        mock.patch.object(caps.definitions, "ensure_cap_pool") as ensure_cap,
    ):
        result = caps.limit_run(signature, budget={"seconds": 60}, countdown=5)
    run_id, limits = open_run.call_args.args
    assert limits == Budget(seconds=60.0)
    ensure_cap.assert_not_called()  # no max_running: no run cap
    signature.apply_async.assert_called_once_with(root_id=run_id, countdown=5)
    assert result is signature.apply_async.return_value


def test_limit_run__budget_and_run_cap_share_the_runs_id() -> None:
    signature = mock.Mock(options={})
    with (
        mock.patch.object(caps.budgets, "open_run") as open_run,
        mock.patch.object(caps.definitions, "ensure_cap_pool") as ensure_cap,
    ):
        caps.limit_run(signature, max_running=3, budget={"tokens": 9}, root_id="wf-1")
    assert open_run.call_args.args == ("wf-1", Budget(tokens=9))
    assert ensure_cap.call_args.args == ("run-cap:wf-1", 3)
    signature.apply_async.assert_called_once_with(root_id="wf-1")


def test_limit_run__bad_budget_or_nothing_to_limit_sends_nothing() -> None:
    signature = mock.Mock(options={})
    with mock.patch.object(caps.budgets, "open_run") as open_run:
        with pytest.raises(PoolConfigurationError, match="positive integer"):
            caps.limit_run(signature, budget={"tokens": 0})
        with pytest.raises(PoolConfigurationError, match="needs max_running=N"):
            caps.limit_run(signature)
    open_run.assert_not_called()
    signature.apply_async.assert_not_called()
