"""PoolSpec validation: bad decorator arguments fail early with an actionable message."""

from __future__ import annotations

from typing import Any

import pytest

from pools.exceptions import PoolConfigurationError, PoolKeyError
from pools.pool_names import validate_pool_name
from pools.specs import PoolSpec


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


def test_resolve_key__callable_of_the_call_arguments() -> None:
    from pools.specs import resolve_key

    assert resolve_key(lambda a, b=0: f"k-{a}-{b}", [1], {"b": 2}, what="job_key") == "k-1-2"
    assert resolve_key(lambda a: a, [7], {}, what="job_key") == "7"  # numbers become text
    assert resolve_key(lambda a: None, [7], {}, what="job_key") is None  # no key this call
    assert resolve_key("fixed", [7], {}, what="job_key") == "fixed"
    assert resolve_key(None, [7], {}, what="job_key") is None


def test_resolve_key__a_failing_or_bad_callable_names_itself() -> None:
    import pytest

    from pools.exceptions import PoolConfigurationError
    from pools.specs import resolve_key

    def order_key(order_id: int) -> str:
        return f"order-{order_id}"

    with pytest.raises(PoolConfigurationError, match=r"order_key.*failed for this call"):
        resolve_key(order_key, [], {"wrong": 1}, what="idempotency_key")
    with pytest.raises(PoolConfigurationError, match="must be a non-empty string"):
        resolve_key(lambda: "", [], {}, what="idempotency_key")


def test_from_dict__accepts_a_concurrency_policy() -> None:
    from pools.specs import PoolSpec

    spec = PoolSpec.from_dict({"pools": "warehouse", "concurrency_policy": "skip"})
    assert spec.concurrency_policy == "skip"


# --------------------------------------------------------------------------- per-key patterns


def test_pattern__accepted_in_a_spec_and_listed_as_pattern() -> None:
    spec = PoolSpec.build({"global": 1, "tenant:{tenant_id}": 2})
    assert spec.patterns == ["tenant:{tenant_id}"]
    assert PoolSpec.build("warehouse").patterns == []


@pytest.mark.parametrize(
    "pattern",
    ["tenant:{}", "tenant:{0}", "tenant:{t.id}", "tenant:{t!r}", "tenant:{t:>3}", "{t", "bad {t}"],
)
def test_pattern__malformed_is_refused_at_decoration(pattern: str) -> None:
    with pytest.raises(PoolConfigurationError, match="pattern"):
        PoolSpec.build(pattern)


def test_resolve__formats_each_pattern_and_keeps_the_lock_order() -> None:
    spec = PoolSpec.build({"b-global": 1, "a:{x}": 2, "z:{x}-{y}": 1})
    resolved = spec.resolve({"x": "k", "y": 7})
    assert resolved.demand == {"a:k": 2, "b-global": 1, "z:k-7": 1}
    assert list(resolved.demand) == sorted(resolved.demand)
    assert resolved.templates == {"a:k": "a:{x}", "z:k-7": "z:{x}-{y}"}
    assert resolved.patterns == []


def test_resolve__missing_argument_or_bad_value_is_a_pool_key_error() -> None:
    spec = PoolSpec.build("tenant:{tenant_id}")
    with pytest.raises(PoolKeyError, match="tenant_id"):
        spec.resolve({}, task="app.job")
    with pytest.raises(PoolKeyError, match="not a valid pool name"):
        spec.resolve({"tenant_id": "a b"})
    with pytest.raises(PoolKeyError, match="twice"):
        PoolSpec.build({"t:{a}": 1, "t:{b}": 1}).resolve({"a": 1, "b": 1})


def test_fairness_key__string_int_callable_and_per_call() -> None:
    from pools.specs import resolve_key

    assert PoolSpec.build("p", fairness_key="acme").fairness_key == "acme"
    assert PoolSpec.build("p", fairness_key=42).fairness_key == "42"
    spec = PoolSpec.build("p", fairness_key=lambda tenant, **kw: f"t-{tenant}")
    assert resolve_key(spec.fairness_key, [5], {}, what="fairness_key") == "t-5"
    per_call = spec.with_call_options({"fairness_key": 9})
    assert resolve_key(per_call.fairness_key, [5], {}, what="fairness_key") == "9"
    assert PoolSpec.from_dict({"pools": "p", "fairness_key": "k"}).fairness_key == "k"


@pytest.mark.parametrize("bad", [["a"], "x" * 256, 1.5, True, ""])
def test_fairness_key__rejects_what_cannot_be_stored(bad: object) -> None:
    with pytest.raises(PoolConfigurationError, match="fairness_key"):
        PoolSpec.build("p", fairness_key=bad)  # type: ignore[arg-type]
    with pytest.raises(PoolConfigurationError, match="fairness_key"):
        PoolSpec.build("p").with_call_options({"fairness_key": bad})
