"""Django system checks for pool configuration (ids ``pools.E001``...) and the Celery side (``pools.W002``, ``pools.W003``)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from django.apps import apps
from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning, register
from django.db import connections

from pools.exceptions import PoolConfigurationError
from pools.specs import PoolSpec

if TYPE_CHECKING:
    from celery import Celery


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


@register()
def check_celery_integration(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """What the Celery side needs: a scheduled sweep and kept worker database connections."""
    app = _celery_app()
    warnings: list[CheckMessage] = []
    if not apps.is_installed("django_celery_beat") and not _sweep_in_beat_schedule(app):
        warnings.append(
            Warning(
                "'django_celery_beat' is not in INSTALLED_APPS, so the pools sweep "
                "('pools.sweep') is never scheduled: slots held by a worker that was killed "
                "are not given back when its lease lapses, queue_timeout deadlines do not "
                "expire waiting entries, and old entries and events are never pruned.",
                id="pools.W002",
                hint="Add 'django_celery_beat' to INSTALLED_APPS, run migrate (it registers "
                "the periodic task 'pools: sweep') and run celery beat with "
                "'-S django_celery_beat.schedulers:DatabaseScheduler'; or schedule the task "
                "'pools.sweep' every POOLS['SWEEP_SECONDS'] in your own beat_schedule.",
            )
        )
    if not _db_reuse_max(app):
        where = f"the Celery app {app.main!r}" if app is not None else "the Django settings"
        warnings.append(
            Warning(
                f"CELERY_DB_REUSE_MAX is not set ({where}): Celery's Django fix-up closes the "
                "database connection before and after every task, so each pooled task opens "
                "new connections to start and settle its claim (a few milliseconds each on "
                "PostgreSQL, more with TLS or a remote server, and a connection storm under "
                "load).",
                id="pools.W003",
                hint="Set CELERY_DB_REUSE_MAX = 1000 in the Django settings (read by "
                "app.config_from_object('django.conf:settings', namespace='CELERY')) to keep "
                "a worker process's connection for about 1000 tasks.",
            )
        )
    return warnings


def _celery_app() -> Celery | None:
    """The project's Celery app, if one was created (``proj/celery.py``), else ``None``.

    ``celery.current_app`` would make up an unconfigured default app when there is none,
    so the current and default apps are read from Celery's state without creating one.
    """
    state: Any = importlib.import_module("celery._state")  # private: not in celery-types
    app: Celery | None = getattr(state._tls, "current_app", None) or state.default_app
    return app


def _sweep_in_beat_schedule(app: Celery | None) -> bool:
    """True if the app's own ``beat_schedule`` runs ``pools.sweep``."""
    if app is None:
        return False
    schedule = app.conf.get("beat_schedule") or {}
    return any(
        isinstance(entry, dict) and entry.get("task") == "pools.sweep"
        for entry in schedule.values()
    )


def _db_reuse_max(app: Celery | None) -> object:
    """``CELERY_DB_REUSE_MAX`` as Celery's Django fix-up reads it (``None`` when unset)."""
    if app is not None:
        # The exact key DjangoWorkerFixup reads: a lowercase app.conf.db_reuse_max is
        # not seen by it (the namespace loader maps CELERY_DB_REUSE_MAX to both).
        return app.conf.get("CELERY_DB_REUSE_MAX")
    # No app to ask: Celery's setting as the Django settings hold it (not a POOLS key, so
    # not in pools.conf).
    return getattr(settings, "CELERY_DB_REUSE_MAX", None)
