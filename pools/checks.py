"""Django system checks for pool configuration (ids ``pools.E001``...) and the Celery side (``pools.W002``, ``pools.W003``; the Celery app itself: ``pools.celery.checks``)."""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

from django.apps import apps
from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.db import DatabaseError, connections

from pools.exceptions import PoolConfigurationError
from pools.specs import PoolSpec

if TYPE_CHECKING:
    from celery import Celery


@register()
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Validate ``settings.POOLS`` and its pool definitions."""
    from pools import conf
    from pools.core import declarations

    try:
        conf.get()
    except PoolConfigurationError as exc:
        return [Error(str(exc), id="pools.E001", hint="Fix settings.POOLS.")]
    errors: list[CheckMessage] = []
    for name, raw in sorted(conf.get().DEFINITIONS.items()):
        try:
            declarations.parse(name, raw)
        except PoolConfigurationError as exc:
            errors.append(Error(str(exc), id="pools.E002", hint="Fix POOLS['DEFINITIONS']."))
    for name, declared in sorted(conf.get().TASKS.items()):
        try:
            PoolSpec.from_dict(declared)
        except PoolConfigurationError as exc:
            errors.append(Error(f"POOLS['TASKS'][{name!r}]: {exc}", id="pools.E003"))
    for pattern, raw in sorted(conf.get().TEMPLATES.items()):
        try:
            template = declarations.parse_template(pattern, raw)
            declarations.values_callable(template)
        except PoolConfigurationError as exc:
            errors.append(Error(str(exc), id="pools.E030", hint="Fix POOLS['TEMPLATES']."))
    errors.extend(_check_patterns_have_templates(conf.get()))
    try:
        declarations.default_pool()
    except PoolConfigurationError as exc:
        errors.append(Error(str(exc), id="pools.E032", hint="Fix POOLS['DEFAULT_POOL']."))
    settings_ = conf.get()
    if settings_.heartbeat_seconds >= settings_.LEASE_SECONDS:
        errors.append(
            Error(
                "POOLS['HEARTBEAT_SECONDS'] must be shorter than POOLS['LEASE_SECONDS'].",
                id="pools.E004",
                hint="Leave HEARTBEAT_SECONDS unset (a third of the lease) or lower it.",
            )
        )
    elif (problem := settings_.timing_violation()) is not None:
        errors.append(
            Error(
                f"The lease timing rule HEARTBEAT < LEASE - FENCE_MARGIN < LEASE + "
                f"REQUEUE_GRACE - CLOCK_SKEW does not hold: {problem}.",
                id="pools.E005",
                hint="Leave HEARTBEAT_SECONDS and FENCE_MARGIN_SECONDS unset (a third of the "
                "lease each), or raise REQUEUE_GRACE_SECONDS above CLOCK_SKEW_SECONDS. See "
                "docs/concepts/leases.md, 'The timing rule'.",
            )
        )
    return errors


def _check_patterns_have_templates(settings_: Any) -> list[CheckMessage]:
    """Every per-key pattern of ``POOLS['TASKS']`` needs a template (``pools.E031``)."""
    errors: list[CheckMessage] = []
    for name, declared in sorted(settings_.TASKS.items()):
        try:
            spec = PoolSpec.from_dict(declared)
        except PoolConfigurationError:
            continue  # reported as pools.E003
        for pattern in spec.patterns:
            if pattern not in settings_.TEMPLATES:
                errors.append(
                    Error(
                        f"POOLS['TASKS'][{name!r}] names the per-key pool {pattern!r}, which "
                        f"has no template.",
                        id="pools.E031",
                        hint=f"Add POOLS['TEMPLATES'] = {{{pattern!r}: {{'slots': 1}}}}.",
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
    app = celery_app()
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
    if not _db_reuse_max(app) and not _own_worker_connection():
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


def celery_app() -> Celery | None:
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


def _own_worker_connection() -> bool:
    """On the PostgreSQL fast path, workers start and settle on pools' own connection.

    Celery's fix-up does not close that one, so CELERY_DB_REUSE_MAX changes nothing there
    (docs/benchmarks.md, "A lean hot path": the same speed set and unset).
    """
    from pools.core.engine import configured

    return configured().own_worker_connection


def _db_reuse_max(app: Celery | None) -> object:
    """``CELERY_DB_REUSE_MAX`` as Celery's Django fix-up reads it (``None`` when unset)."""
    if app is not None:
        # The exact key DjangoWorkerFixup reads: a lowercase app.conf.db_reuse_max is
        # not seen by it (the namespace loader maps CELERY_DB_REUSE_MAX to both).
        return app.conf.get("CELERY_DB_REUSE_MAX")
    # No app to ask: Celery's setting as the Django settings hold it (not a POOLS key, so
    # not in pools.conf).
    return getattr(settings, "CELERY_DB_REUSE_MAX", None)


# --------------------------------------------------------------------------- transaction poolers


def _pooler_configured(db: Any) -> bool:
    """``OPTIONS["prepare_threshold"] = None``: Django's setting for a transaction pooler."""
    options = db.settings_dict.get("OPTIONS") or {}
    return "prepare_threshold" in options and options["prepare_threshold"] is None


@register(deploy=False)
def check_transaction_pooler(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """PostgreSQL behind a transaction pooler (PgBouncer ``pool_mode = transaction``).

    What pools does on PostgreSQL works through one (each operation is one transaction;
    its bounds are ``SET LOCAL``; no advisory lock, ``LISTEN``, server-side cursor or
    session ``SET``) once pools' own connection prepares no statements, which follows
    ``OPTIONS["prepare_threshold"] = None``. These warn about settings that do not.
    """
    from pools import conf

    db = connections["default"]
    if db.vendor != "postgresql" or not _pooler_configured(db):
        return []
    messages: list[CheckMessage] = []
    if conf.get().PREPARED_STATEMENTS:
        messages.append(
            Warning(
                "POOLS['PREPARED_STATEMENTS'] is True while DATABASES['default']['OPTIONS']"
                "['prepare_threshold'] is None (the setting for a transaction pooler): "
                "through PgBouncer in transaction mode every start and settle of a pooled "
                "task then fails with 'prepared statement \"_pg3_0\" already exists', and "
                "pools' own connection sets its statement bound once per session, which does "
                "not follow it from one server connection to the next.",
                id="pools.W040",
                hint="Remove POOLS['PREPARED_STATEMENTS'] (it then follows prepare_threshold) "
                "or set it to False. Keep True only with a direct connection or a pooler in "
                "session mode.",
            )
        )
    if not db.settings_dict.get("DISABLE_SERVER_SIDE_CURSORS"):
        messages.append(
            Warning(
                "DATABASES['default']['OPTIONS']['prepare_threshold'] is None (a transaction "
                "pooler) but DISABLE_SERVER_SIDE_CURSORS is not set: QuerySet.iterator() "
                "outside a transaction declares a cursor on one server connection and reads "
                "it on another ('cursor ... does not exist'). pools itself uses none at run "
                "time; your code and other apps may.",
                id="pools.W041",
                hint="Set DATABASES['default']['DISABLE_SERVER_SIDE_CURSORS'] = True, as "
                "Django's documentation says for transaction pooling.",
            )
        )
    return messages


# --------------------------------------------------------------------------- MySQL / MariaDB

#: Isolation levels under which admission is correct and does not block on gap locks.
MYSQL_ISOLATION_OK = {"read committed"}


def _mysql_isolation_message(level: str, where: str) -> CheckMessage:
    return Warning(
        f"MySQL/MariaDB {where} runs at {level.upper()}: pools wants READ COMMITTED. "
        "Under REPEATABLE READ an enqueue inside a transaction that already read may "
        "read the line of waiting entries from an old snapshot, and InnoDB gap locks make unrelated "
        "pools block (and deadlock) each other.",
        id="pools.W020",
        hint="Set DATABASES['default']['OPTIONS']['isolation_level'] = 'read committed' "
        "(Django's default on MySQL) and do not override it in init_command.",
    )


@register(deploy=False)
def check_mysql_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """MySQL/MariaDB: the configured isolation level (no database access)."""
    db = connections["default"]
    if db.vendor != "mysql":
        return []
    # Django applies READ COMMITTED when the option is not set.
    level = str((db.settings_dict.get("OPTIONS") or {}).get("isolation_level") or "read committed")
    if level.lower() not in MYSQL_ISOLATION_OK:
        return [_mysql_isolation_message(level, "(OPTIONS['isolation_level'])")]
    return []


@register(Tags.database)
def check_mysql_database(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """MySQL/MariaDB, on the server: InnoDB tables and the session's isolation level.

    A database check: runs with ``manage.py check --database default`` and ``migrate``.
    """
    if not databases or "default" not in databases:
        return []
    db = connections["default"]
    if db.vendor != "mysql":
        return []
    messages: list[CheckMessage] = []
    with db.cursor() as cursor:
        cursor.execute(
            "SELECT TABLE_NAME, ENGINE FROM information_schema.TABLES "
            "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME LIKE 'pools\\_%' "
            "AND TABLE_TYPE = 'BASE TABLE' ORDER BY TABLE_NAME"
        )
        not_innodb = [(t, e) for t, e in cursor.fetchall() if str(e).lower() != "innodb"]
        try:  # MySQL 8 / MariaDB >= 11.1; older MariaDB only has tx_isolation
            cursor.execute("SELECT @@SESSION.transaction_isolation")
        except DatabaseError:
            cursor.execute("SELECT @@SESSION.tx_isolation")
        (level,) = cursor.fetchone()
    if not_innodb:
        listed = ", ".join(f"{t} ({e})" for t, e in not_innodb)
        messages.append(
            Error(
                f"pools tables must use InnoDB (row locks, transactions): {listed}.",
                id="pools.E020",
                hint="ALTER TABLE <table> ENGINE=InnoDB for each, and set "
                "default_storage_engine=InnoDB on the server.",
            )
        )
    level = str(level).replace("-", " ").lower()
    if level not in MYSQL_ISOLATION_OK:
        messages.append(_mysql_isolation_message(level, "session"))
    return messages


def pending_migrations() -> list[str]:
    """Migrations of this release's ``pools`` app that the default database has not applied,
    when it has applied some: a database being upgraded. Empty for an up-to-date database,
    a fresh one (``migrate`` creates everything; Django itself lists what is unapplied)
    or one it cannot read."""
    from django.db.migrations.executor import MigrationExecutor

    try:
        executor = MigrationExecutor(connections["default"])
        plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    except DatabaseError:
        return []
    applied = {name for app, name in executor.loader.applied_migrations if app == "pools"}
    if not applied:
        return []
    return [migration.name for migration, backwards in plan if migration.app_label == "pools"]


def unfinished_squash() -> list[str]:
    """Migrations that a squashed migration of ``pools`` replaces and the default database
    has not applied, when it applied some of them: Django then sees neither the squashed
    migration nor the ones it replaces (their files are gone), and ``migrate`` would do
    nothing. Empty otherwise, or when the database cannot be read."""
    from django.db.migrations.loader import MigrationLoader

    try:
        loader = MigrationLoader(connections["default"], ignore_no_migrations=True)
    except DatabaseError:
        return []
    applied = {name for app, name in loader.applied_migrations if app == "pools"}
    for (app, _), migration in loader.disk_migrations.items():
        replaced = {name for label, name in migration.replaces if label == "pools"}
        if app == "pools" and replaced & applied and not replaced <= applied:
            return sorted(replaced - applied)
    return []


def schema_behind_message(pending: list[str]) -> str:
    """One line naming the fix, for the system check and the worker's start."""
    return (
        "The database schema is older than this release of django-celery-pools "
        f"(migrations not applied: {', '.join(pending)}): run 'manage.py migrate'. Until "
        "then pooled calls fail with PoolUnavailable."
    )


@register(Tags.database)
def check_schema(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """The database has this release's migrations (``manage.py check --database default``).

    A warning, not an error: ``migrate`` itself runs the database checks first, and an
    error would stop the command that fixes it.
    """
    if not databases or "default" not in databases:
        return []
    unfinished = unfinished_squash()
    if unfinished:
        return [
            Warning(
                "The database applied only part of the migrations that django-celery-pools "
                f"0.1.0 replaces with one (not applied: {', '.join(unfinished)}): 'manage.py "
                "migrate' sees no migration of pools to apply to it.",
                id="pools.W051",
                hint="Migrate it with the last commit before 0.1.0 (bf7d954) first, then "
                "with this release (see Upgrading in the docs).",
            )
        ]
    if sys.argv[1:2] == ["migrate"]:
        return []  # ``migrate`` runs the database checks first: it is the fix, not the news
    pending = pending_migrations()
    if not pending:
        return _sweep_overdue()
    return [
        Warning(
            schema_behind_message(pending),
            id="pools.W050",
            hint="Deploy in this order: migrate, then restart web processes and workers "
            "(see Upgrading in the docs).",
        )
    ]


def _sweep_overdue() -> list[CheckMessage]:
    """``pools.W060``: celery beat has not sent the sweep lately (beat not running, or not
    with the DatabaseScheduler that reads the periodic task ``migrate`` registered)."""
    from pools.celery import beat

    overdue = beat.sweep_overdue()
    if overdue is None:
        return []
    return [
        Warning(
            overdue + ".",
            id="pools.W060",
            hint="Run celery beat with the DatabaseScheduler: 'celery -A proj beat -S "
            "django_celery_beat.schedulers:DatabaseScheduler' (or CELERY_BEAT_SCHEDULER = "
            "'django_celery_beat.schedulers:DatabaseScheduler'), or embedded in one worker "
            "with -B.",
        )
    ]
