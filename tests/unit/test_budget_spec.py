"""Run budget values: ``pool_options={"budget": ...}``, ``limit_run(budget=...)``."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest

from pools.celery import budgets as celery_budgets
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
    signature = mock.Mock()
    with mock.patch.object(celery_budgets.budgets, "open_run") as open_run:
        result = celery_budgets.limit_run(signature, {"seconds": 60}, countdown=5)
    run_id, limits = open_run.call_args.args
    assert limits == Budget(seconds=60.0)
    signature.apply_async.assert_called_once_with(root_id=run_id, countdown=5)
    assert result is signature.apply_async.return_value


def test_limit_run__bad_budget_or_root_id_sends_nothing() -> None:
    signature = mock.Mock()
    with pytest.raises(PoolConfigurationError):
        celery_budgets.limit_run(signature, {"tokens": 0})
    with pytest.raises(PoolConfigurationError, match="do not pass root_id"):
        celery_budgets.limit_run(signature, {"tokens": 1}, root_id="x")
    signature.apply_async.assert_not_called()
