"""The pool field table: each field's rule once, the fields each surface accepts, and the
surfaces (settings parsers, services, REST body, admin form) reading the same table."""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys
from typing import Any

import pytest

from pools import pool_fields
from pools.core import declarations, pool_crud
from pools.exceptions import PoolConfigurationError
from pools.pool_fields import CRUD, DEFAULT_POOL, FIELDS, SETTINGS, TEMPLATE
from pools.rates_text import UNLIMITED_SLOTS

# --------------------------------------------------------------------------- each rule once

#: (field, a value it takes, that value as stored).
ACCEPTED = [
    ("name", "partner-api", "partner-api"),
    ("slots", 4, 4),
    ("max_queued", None, None),
    ("max_queued", 10, 10),
    ("paused", True, True),
    ("description", 42, "42"),
    ("overflow", "drop_oldest", "drop_oldest"),
    ("paused_policy", "reject", "reject"),
    ("strategy", "fair", "fair"),
    ("aging_seconds", None, None),
    ("aging_seconds", 30, 30),
    ("spend_cap", 3600, 3600.0),
    ("spend_cap", None, None),
    ("rate", ["10/s", " 100000 /d"], "10/s,100000/d"),
    ("rate", None, ""),
]

#: (field, a value it refuses, the message it gives).
REFUSED = [
    ("name", "bad name", "Invalid pool name 'bad name'"),
    ("name", "run-cap:x", "'run-cap:x' starts with 'run-cap:', which is reserved"),
    ("slots", 0, "slots must be a positive integer, got 0."),
    ("slots", True, "slots must be a positive integer, got True."),
    ("slots", None, "slots must be a positive integer, got None."),
    ("max_queued", 0, "max_queued must be a positive integer, got 0."),
    ("paused", 1, "paused must be true or false, got 1."),
    ("overflow", "drop_all", "overflow must be one of ['reject', 'drop_oldest', 'drop_newest']"),
    ("paused_policy", "wait", "paused_policy must be one of ['queue', 'reject']"),
    ("strategy", "random", "strategy must be one of ['priority', 'fifo', 'lifo', 'fair']"),
    ("aging_seconds", 1.5, "aging_seconds must be a positive integer, got 1.5."),
    ("spend_cap", 0, "spend_cap must be a positive number of slot-seconds per UTC day"),
    ("spend_cap", False, "spend_cap must be a positive number of slot-seconds per UTC day"),
    ("rate", "5/y", "rate: '5/y' is not a rate; use N/s, N/m, N/h or N/d"),
]


@pytest.mark.parametrize(("name", "value", "stored"), ACCEPTED)
def test_check__takes_a_valid_value_in_its_stored_form(name: str, value: Any, stored: Any) -> None:
    assert pool_fields.check(name, value) == stored


@pytest.mark.parametrize(("name", "value", "message"), REFUSED)
def test_check__refuses_with_one_message_naming_the_field(
    name: str, value: Any, message: str
) -> None:
    with pytest.raises(PoolConfigurationError) as info:
        pool_fields.check(name, value)
    assert message in str(info.value)
    assert info.value.field == name


def test_check__every_field_has_a_rule_here() -> None:
    assert {name for name, _v, _s in ACCEPTED} == set(FIELDS) - {"queues"}
    assert {name for name, _v, _m in REFUSED} == set(FIELDS) - {"queues", "description"}


def test_queues__the_default_pool_only() -> None:
    where = "POOLS['DEFAULT_POOL']"
    read = pool_fields.read(DEFAULT_POOL, where, {"slots": 2, "queues": ["a", "b"]})
    assert read["queues"] == frozenset({"a", "b"})
    with pytest.raises(PoolConfigurationError, match=r"\['queues'\] must be a non-empty list"):
        pool_fields.read(DEFAULT_POOL, where, {"slots": 2, "queues": "celery"})
    with pytest.raises(PoolConfigurationError, match="Unknown pool field 'queues'"):
        pool_fields.check("queues", ["celery"])


def test_check_order__aging_needs_strategy_priority() -> None:
    pool_fields.check_order("priority", 30)
    pool_fields.check_order("fifo", None)
    with pytest.raises(PoolConfigurationError, match="aging_seconds applies to strategy") as info:
        pool_fields.check_order("fifo", 30, where="POOLS['DEFINITIONS']['x']")
    assert str(info.value).startswith("POOLS['DEFINITIONS']['x']: ")
    assert info.value.field == "aging_seconds"


# --------------------------------------------------------------------------- surfaces

_SETTINGS_FIELDS = {
    "slots",
    "max_queued",
    "paused",
    "description",
    "overflow",
    "paused_policy",
    "strategy",
    "aging_seconds",
    "spend_cap",
    "rate",
}
SURFACE_FIELDS = {
    SETTINGS: _SETTINGS_FIELDS,
    DEFAULT_POOL: {"name", "slots", "queues", "max_queued"},
    TEMPLATE: {"slots", "max_queued", "description", "strategy", "aging_seconds", "rate"},
    CRUD: {"name", *_SETTINGS_FIELDS},
}


#: A valid value of each field, to offer it to every surface.
SAMPLE = {
    "name": "sample",
    "slots": 2,
    "max_queued": 5,
    "paused": True,
    "description": "d",
    "overflow": "drop_newest",
    "paused_policy": "reject",
    "strategy": "fifo",
    "aging_seconds": None,
    "spend_cap": 60,
    "rate": "1/s",
    "queues": ["celery"],
}


def _offer(surface: str, name: str) -> None:
    """Give ``name`` alone (with slots) to ``surface``'s own parser or service check."""
    raw = {name: SAMPLE[name]} if name == "slots" else {"slots": 1, name: SAMPLE[name]}
    if surface == SETTINGS:
        declarations.parse("x", raw)
    elif surface == TEMPLATE:
        declarations.parse_template("tenant:{tenant_id}", raw)
    elif surface == DEFAULT_POOL:
        declarations.parse_default_pool(raw)
    else:
        pool_fields.check_fields(raw)


@pytest.mark.parametrize("surface", pool_fields.SURFACES)
def test_surface__takes_its_fields_and_refuses_the_others(surface: str) -> None:
    assert set(pool_fields.names(surface)) == SURFACE_FIELDS[surface]
    assert set(SAMPLE) == set(FIELDS)
    for name in FIELDS:
        if name in SURFACE_FIELDS[surface]:
            _offer(surface, name)
        else:
            with pytest.raises(PoolConfigurationError, match=r"[Uu]nknown"):
                _offer(surface, name)


def test_surfaces__give_the_same_rule_with_where_it_is() -> None:
    messages = []
    for call in (
        lambda: declarations.parse("x", {"slots": 1, "max_queued": 0}),
        lambda: declarations.parse_template("t:{k}", {"slots": 1, "max_queued": 0}),
        lambda: declarations.parse_default_pool({"slots": 1, "max_queued": 0}),
        lambda: pool_fields.check_fields({"max_queued": 0}),
    ):
        with pytest.raises(PoolConfigurationError) as info:
            call()
        assert info.value.field == "max_queued"
        messages.append(str(info.value))
    assert messages == [
        "POOLS['DEFINITIONS']['x']['max_queued'] must be a positive integer, got 0.",
        "POOLS['TEMPLATES']['t:{k}']['max_queued'] must be a positive integer, got 0.",
        "POOLS['DEFAULT_POOL']['max_queued'] must be a positive integer, got 0.",
        "max_queued must be a positive integer, got 0.",
    ]


def test_paused__settings_take_any_truth_value_the_services_a_bool() -> None:
    assert declarations.parse("x", {"slots": 1, "paused": 1}).paused is True
    with pytest.raises(PoolConfigurationError, match="paused must be true or false"):
        pool_fields.check("paused", 1)


def test_slots__a_rate_alone_means_unlimited_slots_else_they_are_needed() -> None:
    assert declarations.parse("x", {"rate": "5/s"}).slots == UNLIMITED_SLOTS
    assert declarations.parse_template("t:{k}", {"rate": "5/s"}).slots == UNLIMITED_SLOTS
    with pytest.raises(PoolConfigurationError, match=r"\['x'\] needs 'slots' \(or a 'rate'"):
        declarations.parse("x", {"max_queued": 3})
    with pytest.raises(PoolConfigurationError, match=r"needs 'slots' \(the capacity of each"):
        declarations.parse_template("t:{k}", {})
    with pytest.raises(PoolConfigurationError, match=r"needs 'slots' \(the capacity of the"):
        declarations.parse_default_pool({"name": "d"})


def test_settings__not_a_dict_is_refused_with_an_example() -> None:
    with pytest.raises(PoolConfigurationError, match=r"must be a dict such as \{'slots': 4\}"):
        declarations.parse("x", 4)
    with pytest.raises(PoolConfigurationError, match=r"such as \{'name': 'default', 'slots'"):
        declarations.parse_default_pool(["default"])


# --------------------------------------------------------------------------- one table


@pytest.mark.parametrize("cls", [declarations.PoolDefinition, declarations.PoolTemplate])
def test_settings_values__defaults_are_the_table_defaults(cls: type) -> None:
    for f in dataclasses.fields(cls):
        if f.name in FIELDS and f.default is not dataclasses.MISSING:
            assert f.default == FIELDS[f.name].default, f.name


def test_create_pool__defaults_are_the_table_defaults() -> None:
    parameters = inspect.signature(pool_crud.create_pool).parameters
    assert set(parameters) == set(pool_fields.names(CRUD)) | {"actor"}
    for name, parameter in parameters.items():
        if name in FIELDS and parameter.default is not inspect.Parameter.empty:
            assert parameter.default == FIELDS[name].default, name


def test_rest_body__every_service_field_is_checked_by_the_table() -> None:
    from pools.api.serializers import PoolInputSerializer

    serializer = PoolInputSerializer()
    assert set(serializer.fields) == set(pool_fields.names(CRUD))
    with pytest.raises(Exception, match="max_queued must be a positive integer"):
        serializer.validate_max_queued(0)
    assert serializer.validate_rate(["10/s", "1/m"]) == "10/s,1/m"
    for name in pool_fields.names(CRUD):
        assert callable(getattr(serializer, f"validate_{name}")), name


def test_admin_form__shows_the_service_fields() -> None:
    from pools_admin.forms import PoolForm

    assert tuple(PoolForm.base_fields) == pool_fields.names(CRUD)


def test_pure_modules__import_no_model_and_no_core_without_settings() -> None:
    """Models and specs sit on these: they import neither models nor the core (which reads
    the database), and need no Django settings."""
    code = (
        "import sys, pools.pool_fields, pools.specs, pools.rates_text; "
        "bad = sorted(m for m in sys.modules if m.startswith(('pools.core', 'pools.models', "
        "'pools.querysets'))); print(bad); sys.exit(1 if bad else 0)"
    )
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
