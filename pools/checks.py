"""Django system checks for pool configuration (ids ``pools.E001``...)."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error, Warning, register
from django.db import connections

from pools.exceptions import PoolConfigurationError
from pools.specs import PoolSpec


@register()
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Validate ``settings.POOLS`` and its pool definitions."""
    from pools import conf
    from pools.core import definitions

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
    for name, declared in sorted(conf.get().TASKS.items()):
        try:
            PoolSpec.from_dict(declared)
        except PoolConfigurationError as exc:
            errors.append(Error(f"POOLS['TASKS'][{name!r}]: {exc}", id="pools.E003"))
    settings_ = conf.get()
    if settings_.heartbeat_seconds >= settings_.LEASE_SECONDS:
        errors.append(
            Error(
                "POOLS['HEARTBEAT_SECONDS'] must be shorter than POOLS['LEASE_SECONDS'].",
                id="pools.E004",
                hint="Leave HEARTBEAT_SECONDS unset (a third of the lease) or lower it.",
            )
        )
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
