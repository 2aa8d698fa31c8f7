"""Per-key limit values, the pure parts: a key's fields read back from a pool name, the
check of limit values, the labels of overrides and the template's ``values`` key."""

from __future__ import annotations

from typing import Any

import pytest
from pytest_django import Settings

from pools import rates_text
from pools.core import overrides
from pools.core.declarations import parse_template
from pools.exceptions import PoolConfigurationError
from pools.pool_names import key_fields


@pytest.mark.parametrize(
    ("pattern", "name", "fields"),
    [
        ("tenant:{tenant_id}", "tenant:acme", {"tenant_id": "acme"}),
        ("tenant:{tenant_id}", "tenant:a:b", {"tenant_id": "a:b"}),
        ("{region}-{tenant}", "eu-acme-2", {"region": "eu", "tenant": "acme-2"}),
        ("tenant:{tenant_id}", "other:acme", None),
        ("tenant:{tenant_id}", "tenant:", None),
        ("a.{x}", "aZb", None),  # the literal dot is a dot, not any character
    ],
)
def test_key_fields__read_back_from_the_name(
    pattern: str, name: str, fields: dict[str, str] | None
) -> None:
    assert key_fields(pattern, name) == fields


def test_check_values__stored_forms_and_messages() -> None:
    assert overrides.check_values(None, where="w") == {}
    assert overrides.check_values(
        {"rate": ["10/s", "100/d"], "max_queued": None, "slots": 3}, where="w"
    ) == {"slots": 3, "rate": "10/s,100/d", "max_queued": None}
    with pytest.raises(PoolConfigurationError, match=r"^w\['slots'\] must be a positive"):
        overrides.check_values({"slots": -1}, where="w")
    with pytest.raises(PoolConfigurationError, match=r"^slots must be a positive"):
        overrides.check_values({"slots": "x"}, where="")
    with pytest.raises(PoolConfigurationError, match=r"w must return a dict"):
        overrides.check_values(("slots", 1), where="w")
    with pytest.raises(PoolConfigurationError, match=r"unknown limit\(s\) \['description'\]"):
        overrides.check_values({"description": "x"}, where="w")


def test_labels__say_value_and_template(settings: Settings) -> None:
    settings.POOLS = {
        **settings.POOLS,
        "TEMPLATES": {"t:{k}": {"slots": 2, "max_queued": 10, "rate": "1/s"}},
    }
    detail = overrides.detail(
        "t:{k}", {"slots": rates_text.UNLIMITED_SLOTS, "rate": "5/s,9/m", "max_queued": None}
    )
    assert overrides.labels(detail) == [
        "slots unlimited (override; template 2)",
        "rate 5/s, 9/m (override; template 1/s)",
        "max_queued unlimited (override; template 10)",
    ]
    assert overrides.detail("t:{k}", {}) == {}
    assert overrides.detail("gone:{k}", {"slots": 3}) == {}  # pattern no longer in settings


def test_limits__sources_in_order() -> None:
    limits = overrides.Limits(
        pattern="t:{k}",
        template={"slots": 2, "rate": "", "max_queued": None},
        plan={"slots": 4, "rate": "1/s"},
        override={"slots": 8},
    )
    assert limits.values == {"slots": 8, "rate": "1/s", "max_queued": None}
    assert limits.base == {"slots": 4, "rate": "1/s", "max_queued": None}
    assert [limits.source(f) for f in ("slots", "rate", "max_queued")] == [
        "override",
        "values",
        "template",
    ]


@pytest.mark.parametrize("bad", ["limits_for", 3, "my app.plans.f", "", None])
def test_template_values__must_be_a_dotted_path(bad: Any) -> None:
    with pytest.raises(PoolConfigurationError, match=r"\['values'\] must be the dotted path"):
        parse_template("t:{k}", {"slots": 1, "values": bad})


def test_template_values__kept_and_not_a_pool_field() -> None:
    template = parse_template("t:{k}", {"slots": 1, "values": "myapp.plans.limits_for"})
    assert (template.values, template.slots) == ("myapp.plans.limits_for", 1)
    assert parse_template("t:{k}", {"slots": 1}).values == ""
