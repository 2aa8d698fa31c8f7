"""Settings for the test suite.

``POOLS_TEST_DB=postgres`` runs on PostgreSQL (127.0.0.1:5432, user postgres; ``POOLS_PG_PORT``
another port, ``POOLS_PG_POOLER=transaction`` for a transaction pooler on that port);
``POOLS_TEST_DB=mysql`` on MariaDB/MySQL (``POOLS_MYSQL_HOST``/``_PORT``/``_USER``/``_PASSWORD``,
default 127.0.0.1:3306 root without password; database ``POOLS_MYSQL_NAME``, test database
``POOLS_MYSQL_TEST_NAME``); the default is SQLite in WAL mode with IMMEDIATE transactions.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Any

SECRET_KEY = "tests-not-secret"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "tests.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "django_celery_beat",
    "pools",
    "pools_admin",
    "tests.testapp",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
STATIC_URL = "/static/"

DB_KIND = os.environ.get("POOLS_TEST_DB", "sqlite")
if DB_KIND == "postgres":
    DATABASES: dict[str, dict[str, Any]] = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": os.environ.get("POOLS_PG_NAME", "pools"),
            "USER": "postgres",
            "HOST": "127.0.0.1",
            "PORT": os.environ.get("POOLS_PG_PORT", "5432"),
            "TEST": {"NAME": os.environ.get("POOLS_PG_TEST_NAME", "test_pools")},
        }
    }
    # Through a transaction pooler (`make test-pgbouncer`: POOLS_PG_PORT is PgBouncer's port
    # and POOLS_PG_POOLER=transaction): Django's documented settings for one.
    if os.environ.get("POOLS_PG_POOLER") == "transaction":
        DATABASES["default"]["OPTIONS"] = {"prepare_threshold": None}
        DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = True
    elif os.environ.get("POOLS_PG_POOLER"):
        raise ValueError("POOLS_PG_POOLER must be 'transaction' or unset")
elif DB_KIND == "mysql":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.mysql",
            "NAME": os.environ.get("POOLS_MYSQL_NAME", "pools"),
            "USER": os.environ.get("POOLS_MYSQL_USER", "root"),
            "PASSWORD": os.environ.get("POOLS_MYSQL_PASSWORD", ""),
            "HOST": os.environ.get("POOLS_MYSQL_HOST", "127.0.0.1"),
            "PORT": os.environ.get("POOLS_MYSQL_PORT", "3306"),
            # READ COMMITTED (Django's default on MySQL, spelled out: pools.W020 checks it)
            # and utf8mb4 for task names and keys.
            # POOLS_MYSQL_ISOLATION only to measure another level (docs/concepts/databases.md).
            "OPTIONS": {
                "isolation_level": os.environ.get("POOLS_MYSQL_ISOLATION", "read committed"),
                "charset": "utf8mb4",
            },
            "TEST": {
                "NAME": os.environ.get("POOLS_MYSQL_TEST_NAME", "test_pools"),
                "CHARSET": "utf8mb4",
            },
        }
    }
else:
    # One directory per checkout: two checkouts testing at once (a CI clone beside a work
    # tree) must not share a test database file.
    _checkout = hashlib.sha256(os.path.dirname(os.path.abspath(__file__)).encode()).hexdigest()
    _dir = os.environ.get("POOLS_SQLITE_DIR") or os.path.join(
        tempfile.gettempdir(), f"pools-tests-{_checkout[:10]}"
    )
    os.makedirs(_dir, exist_ok=True)
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": os.path.join(_dir, "pools-tests.sqlite3"),
            "OPTIONS": {
                "transaction_mode": "IMMEDIATE",
                "timeout": 20,
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
            "TEST": {"NAME": os.path.join(_dir, "test-pools.sqlite3")},
        }
    }

CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "memory://")
CELERY_RESULT_BACKEND = os.environ.get("CELERY_RESULT_BACKEND", "cache+memory://")
CELERY_TASK_ACKS_LATE = True
# Each worker also consumes its own direct queue (node affinity: pool_options={"worker": ...}).
CELERY_WORKER_DIRECT = True
CELERY_WORKER_PREFETCH_MULTIPLIER = int(os.environ.get("POOLS_TEST_PREFETCH", "1"))
# Keep worker database connections between tasks (Celery's Django fixup otherwise closes
# them before and after every task, and each pooled task would reconnect to settle).
CELERY_DB_REUSE_MAX = int(os.environ.get("CELERY_DB_REUSE_MAX", "1000")) or None  # 0: unset

POOLS: dict[str, Any] = {
    "DEFINITIONS": {
        "warehouse": {"slots": 2, "max_queued": 50},
        "partner-api": {"slots": 1},
    },
}
# Fault tests start workers with short leases / fast sweeps through the environment.
for _key in ("LEASE_SECONDS", "HEARTBEAT_SECONDS", "SWEEP_SECONDS"):
    if os.environ.get(f"POOLS_{_key}"):
        POOLS[_key] = float(os.environ[f"POOLS_{_key}"])

# The typed-arguments acceptance test runs the workers on one engine or the other.
if os.environ.get("POOLS_TEST_SQL_FAST_PATH"):
    POOLS["SQL_FAST_PATH"] = os.environ["POOLS_TEST_SQL_FAST_PATH"] == "1"
# The typed-arguments acceptance test's workers take every serializer Celery ships (it
# sends with each); callers still send JSON unless a call says otherwise.
if os.environ.get("POOLS_TEST_SERIALIZERS"):
    CELERY_ACCEPT_CONTENT = os.environ["POOLS_TEST_SERIALIZERS"].split(",")

# The default-pool acceptance test starts workers with POOLS["DEFAULT_POOL"] (JSON).
if os.environ.get("POOLS_TEST_DEFAULT_POOL"):
    POOLS["DEFAULT_POOL"] = json.loads(os.environ["POOLS_TEST_DEFAULT_POOL"])

# The PgBouncer tier's sabotage twin forces pools' own connection to prepare statements.
if os.environ.get("POOLS_TEST_PREPARED_STATEMENTS"):
    POOLS["PREPARED_STATEMENTS"] = os.environ["POOLS_TEST_PREPARED_STATEMENTS"] == "1"

# Extra task modules for the fault-tolerance acceptance tests.
CELERY_IMPORTS = [
    "tests.testapp.fault_tasks",
    "tests.browser.tasks",  # the browser scenario
    "tests.testapp.rate_tasks",  # the rate-limit acceptance tests (issue 17)
    "tests.testapp.typed_tasks",  # typed arguments under every serializer
]
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"

# The REST API's OpenAPI schema (drf-spectacular, the "api" extra).
REST_FRAMEWORK = {"DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema"}
SPECTACULAR_SETTINGS = {"TITLE": "django-celery-pools", "VERSION": "0.1.0"}
