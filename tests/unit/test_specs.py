"""PoolSpec validation: bad decorator arguments fail early with an actionable message."""

from __future__ import annotations

from typing import Any

import pytest

from pools.exceptions import PoolConfigurationError
from pools.specs import PoolSpec, validate_pool_name


@pytest.mark.parametrize("name", ["warehouse", "partner-api", "tenant:42", "a.b_c", "9lives"])
def test_validate_pool_name__accepts_valid(name: str) -> None:
    assert validate_pool_name(name) == name


@pytest.mark.parametrize("name", ["", "-x", "has space", "x" * 101, 3, None, "ümlaut"])
def test_validate_pool_name__rejects_invalid(name: object) -> None:
    with pytest.raises(PoolConfigurationError, match="Invalid pool name"):
        validate_pool_name(name)


def test_build__single_pool() -> None:
    spec = PoolSpec.build("warehouse", 2, priority=10, queue_timeout=1800)
    assert spec.demand == {"warehouse": 2}
    assert (spec.priority, spec.queue_timeout) == (10, 1800.0)


def test_build__multi_pool_sorted_by_lock_order() -> None:
    spec = PoolSpec.build({"warehouse": 1, "partner-api": 2})
    assert list(spec.demand) == ["partner-api", "warehouse"]


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (("p", 0), {}, "positive integer"),
        (("p", -1), {}, "positive integer"),
        (("p", True), {}, "positive integer"),
        (({},), {}, "at least one pool"),
        (({"a": 1}, 2), {}, "inside the dict"),
        (({"a": 0},), {}, "positive integer"),
        ((["a"],), {}, "pool name or a"),
        (("p",), {"priority": "high"}, "priority must be an integer"),
        (("p",), {"queue_timeout": 0}, "queue_timeout must be a positive"),
        (("p",), {"queue_timeout": -5}, "queue_timeout must be a positive"),
    ],
)
def test_build__rejects_bad_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(PoolConfigurationError, match=match):
        PoolSpec.build(*args, **kwargs)


def test_with_call_options__overrides_priority_and_timeout() -> None:
    spec = PoolSpec.build("p", priority=1).with_call_options({"priority": 7, "queue_timeout": 5})
    assert (spec.priority, spec.queue_timeout) == (7, 5.0)


def test_with_call_options__rejects_unknown_keys() -> None:
    with pytest.raises(PoolConfigurationError, match="Unknown pool_options"):
        PoolSpec.build("p").with_call_options({"prio": 1})


def test_from_dict__settings_form() -> None:
    spec = PoolSpec.from_dict({"pools": {"a": 1}, "priority": 3})
    assert spec.demand == {"a": 1} and spec.priority == 3
    with pytest.raises(PoolConfigurationError, match="expected keys"):
        PoolSpec.from_dict({"pool": "a"})


def test_fairness_key__string_int_callable_and_per_call() -> None:
    assert PoolSpec.build("p", fairness_key="acme").fairness == "acme"
    assert PoolSpec.build("p", fairness_key=42).fairness == "42"
    spec = PoolSpec.build("p", fairness_key=lambda tenant, **kw: f"t-{tenant}")
    assert spec.fairness == ""  # a callable is resolved per call
    assert spec.for_call((5,), {}).fairness == "t-5"
    assert spec.with_call_options({"fairness_key": "x"}).for_call((5,), {}).fairness == "x"
    assert PoolSpec.from_dict({"pools": "p", "fairness_key": "k"}).fairness == "k"


@pytest.mark.parametrize("bad", [["a"], "x" * 256, 1.5, True])
def test_fairness_key__rejects_what_cannot_be_stored(bad: object) -> None:
    with pytest.raises(PoolConfigurationError, match="fairness_key"):
        PoolSpec.build("p", fairness_key=bad)  # type: ignore[arg-type]
    with pytest.raises(PoolConfigurationError, match="fairness_key"):
        PoolSpec.build("p").with_call_options({"fairness_key": bad})


def test_fairness_key__a_failing_callable_names_the_fix() -> None:
    spec = PoolSpec.build("p", fairness_key=lambda tenant_id: tenant_id)
    with pytest.raises(PoolConfigurationError, match="receives the task's own arguments"):
        spec.for_call((), {"other": 1})
    with pytest.raises(PoolConfigurationError, match="callable's result"):
        PoolSpec.build("p", fairness_key=lambda: None).for_call((), {})
