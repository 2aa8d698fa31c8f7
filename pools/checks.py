"""Django system checks for pool configuration (ids ``pools.E001``...)."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error, Warning, register
from django.db import connections

from pools.exceptions import PoolConfigurationError


@register()
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Validate ``settings.POOLS`` and its pool definitions."""
    from pools import conf, definitions

    try:
        conf.get()
    except PoolConfigurationError as exc:
        return [Error(str(exc), id="pools.E001", hint="Fix settings.POOLS.")]
    errors: list[CheckMessage] = []
    for name, raw in sorted(conf.get().DEFINITIONS.items()):
        try:
            definitions.parse(name, raw)
        except PoolConfigurationError as exc:
            errors.append(Error(str(exc), id="pools.E002", hint="Fix POOLS['DEFINITIONS']."))
    if conf.get().LEASE_SECONDS <= 0:
        errors.append(Error("POOLS['LEASE_SECONDS'] must be positive.", id="pools.E003"))
    return errors


@register(deploy=False)
def check_database(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """SQLite must run IMMEDIATE transactions for admission to serialize."""
    db = connections["default"]
    if (
        db.vendor == "sqlite"
        and (db.settings_dict.get("OPTIONS") or {}).get("transaction_mode") != "IMMEDIATE"
    ):
        return [
            Warning(
                "SQLite without IMMEDIATE transactions: concurrent admissions may fail with "
                "'database is locked'.",
                id="pools.W001",
                hint="Set DATABASES['default']['OPTIONS'] = {'transaction_mode': 'IMMEDIATE', "
                "'init_command': 'PRAGMA journal_mode=WAL;'}.",
            )
        ]
    return []
