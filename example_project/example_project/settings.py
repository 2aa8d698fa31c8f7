"""Settings of the example project.

With no environment variables everything is embedded, no servers needed:
SQLite (WAL, IMMEDIATE transactions) and kombu's ``filesystem://`` broker with
Celery's file result backend, all under ``example_project/var/`` (or
``$EXAMPLE_VAR_DIR``). For PostgreSQL + Redis set ``DATABASE_URL``,
``CELERY_BROKER_URL`` and ``CELERY_RESULT_BACKEND``.
"""

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("EXAMPLE_VAR_DIR") or BASE_DIR / "var").resolve()
VAR_DIR.mkdir(parents=True, exist_ok=True)

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-project-not-secret")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "example_project.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
STATIC_URL = "/static/"

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
    "drf_spectacular_sidecar",  # Swagger UI files served locally, no CDN
    "django_celery_beat",
    "pools",
    "pools_admin",
    "demo",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
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

# --- Database: SQLite file by default, anything dj-database-url understands otherwise.
if os.environ.get("DATABASE_URL"):
    import dj_database_url

    DATABASES = {"default": dj_database_url.config(conn_max_age=60)}
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": VAR_DIR / "demo.sqlite3",
            "OPTIONS": {
                # IMMEDIATE transactions serialize writers the way row locks do on PostgreSQL.
                "transaction_mode": "IMMEDIATE",
                "timeout": 20,
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
        }
    }

# --- Celery: the embedded filesystem broker + file results by default.
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "filesystem://localhost/")
if CELERY_BROKER_URL.startswith("filesystem"):
    _queue = VAR_DIR / "broker" / "queue"  # producers write and workers read the same folder
    _processed = VAR_DIR / "broker" / "processed"
    _control = VAR_DIR / "broker" / "control"
    for _folder in (_queue, _processed, _control):
        _folder.mkdir(parents=True, exist_ok=True)
    # kombu's filesystem transport, writing each message file whole (see broker.py).
    CELERY_BROKER_TRANSPORT = "example_project.broker:Transport"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_queue),
        "data_folder_out": str(_queue),
        "processed_folder": str(_processed),
        "control_folder": str(_control),
        "polling_interval": 0.1,
    }
_results = VAR_DIR / "results"
_results.mkdir(exist_ok=True)
CELERY_RESULT_BACKEND = os.environ.get("CELERY_RESULT_BACKEND", _results.as_uri())
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# Keep worker database connections between tasks (Celery's Django fixup otherwise closes
# them before and after every task, and each pooled task would reconnect to settle).
CELERY_DB_REUSE_MAX = 1000
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Beat reads its schedule from the database; `migrate` registers the pools sweep there.
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"

# --- The REST API (pools.urls under /api/) and its OpenAPI schema, UI served locally.
REST_FRAMEWORK = {"DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema"}
SPECTACULAR_SETTINGS = {
    "TITLE": "django-celery-pools example",
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
}

# --- The pools tasks in demo/tasks.py use.
POOLS = {
    "DEFINITIONS": {
        "warehouse": {
            "slots": 4,
            "description": "The analytics warehouse: 4 heavy queries at once.",
        },
        "partner-api": {
            "slots": 2,
            "rate": "1/s",
            "description": "A partner's HTTP API: 2 requests at once, 1 started per second.",
        },
        "reports": {"slots": 3, "description": "PDF rendering."},
    },
}
