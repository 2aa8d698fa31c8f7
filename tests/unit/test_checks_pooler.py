"""System checks and the prepare switch for a transaction pooler (pools.W040, pools.W041).

No database access: the checks read the settings, and ``fastpath.prepared_statements``
reads ``POOLS`` and ``DATABASES["default"]["OPTIONS"]``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections
from django.test import override_settings

from pools import conf
from pools.checks import check_transaction_pooler
from pools.exceptions import PoolConfigurationError
from pools.pg import fastpath


@pytest.fixture
def db_settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """The default connection's settings dict, as PostgreSQL, changed for one test."""
    db = connections["default"]
    monkeypatch.setattr(db, "vendor", "postgresql")
    monkeypatch.setattr(db, "settings_dict", {**db.settings_dict, "OPTIONS": {}})
    yield db.settings_dict


def _ids() -> list[str]:
    return [m.id or "" for m in check_transaction_pooler()]


@pytest.mark.parametrize(
    ("options", "pools", "prepared"),
    [
        ({}, {}, True),  # a direct connection: prepared, as before
        ({"prepare_threshold": 5}, {}, True),
        ({"prepare_threshold": None}, {}, False),  # Django's setting for a pooler
        ({"prepare_threshold": None}, {"PREPARED_STATEMENTS": True}, True),
        ({}, {"PREPARED_STATEMENTS": False}, False),
        ({"prepare_threshold": None}, {"PREPARED_STATEMENTS": None}, False),
    ],
)
def test_prepared_statements__follow_options_unless_pools_says(
    db_settings: dict[str, Any], options: dict[str, Any], pools: dict[str, Any], prepared: bool
) -> None:
    db_settings["OPTIONS"] = options
    with override_settings(POOLS=pools):
        assert fastpath.prepared_statements() is prepared
        assert fastpath._prepare_params() == ({} if prepared else {"prepare_threshold": None})


def test_prepared_statements__setting_must_be_a_bool_or_none() -> None:
    with (
        override_settings(POOLS={"PREPARED_STATEMENTS": "no"}),
        pytest.raises(PoolConfigurationError, match="PREPARED_STATEMENTS"),
    ):
        conf.get()


def test_checks__direct_connection_says_nothing(db_settings: dict[str, Any]) -> None:
    with override_settings(POOLS={"PREPARED_STATEMENTS": True}):
        assert _ids() == []


def test_checks__pooler_with_prepared_statements_forced_on_warns(
    db_settings: dict[str, Any],
) -> None:
    db_settings["OPTIONS"] = {"prepare_threshold": None}
    db_settings["DISABLE_SERVER_SIDE_CURSORS"] = True
    with override_settings(POOLS={}):
        assert _ids() == []
    with override_settings(POOLS={"PREPARED_STATEMENTS": True}):
        assert _ids() == ["pools.W040"]
        assert "already exists" in check_transaction_pooler()[0].msg


def test_checks__pooler_with_server_side_cursors_warns(db_settings: dict[str, Any]) -> None:
    db_settings["OPTIONS"] = {"prepare_threshold": None}
    db_settings.pop("DISABLE_SERVER_SIDE_CURSORS", None)
    with override_settings(POOLS={}):
        assert _ids() == ["pools.W041"]
        assert "DISABLE_SERVER_SIDE_CURSORS" in (check_transaction_pooler()[0].hint or "")
