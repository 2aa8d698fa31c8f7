"""Settings of the peer-suite runs, laid out as a user's project (docs/quickstart.md).

Pooled modes: Django settings of a project on PostgreSQL whose Celery app reads its
configuration from here (``config_from_object("django.conf:settings", namespace="CELERY")``,
:mod:`tests.peer.worker_app`), every task of Celery's suite pooled by name, and the pools
defaults a user gets: the SQL fast path on, pools' own connection in each worker process,
``CELERY_DB_REUSE_MAX`` and a prefetch multiplier of 1 as the quick start sets them.
The plain mode reads the same ``CELERY_*`` values from this module without Django, so the
two modes differ in the pools and nothing else.

``POOLS_PEER_SLOTS`` is the capacity of the one pool ``suite``; ``POOLS_PEER_TASKS`` names
a JSON file listing the task names to pool (written by :mod:`tests.peer.run`);
``POOLS_PEER_FAST_PATH=off`` runs the portable ORM path instead (a comparison knob).
"""

from __future__ import annotations

import json
import os

SECRET_KEY = "peer-suite-not-secret"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django_celery_beat",
    "pools",
]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("POOLS_PEER_DB", "pools_peer"),
        "USER": "postgres",
        "HOST": "127.0.0.1",
        "PORT": "5432",
    }
}

# --- Celery, as Celery's integration suite configures its worker, plus the quick start's
# two lines. Read by both modes (the plain one without Django).
CELERY_BROKER_URL = os.environ.get("TEST_BROKER", "redis://127.0.0.1:6379/8")
CELERY_RESULT_BACKEND = os.environ.get("TEST_BACKEND", "redis://127.0.0.1:6379/0")
CELERY_RESULT_EXTENDED = True
CELERY_TASK_CREATE_MISSING_QUEUES = False
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_INCLUDE = ["t.integration.tasks"]
# docs/quickstart.md: an admitted message holds its slots; keep worker DB connections.
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_DB_REUSE_MAX = 1000

_tasks_file = os.environ.get("POOLS_PEER_TASKS")
_names: list[str] = json.loads(open(_tasks_file).read()) if _tasks_file else []
POOLS = {
    "DEFINITIONS": {"suite": {"slots": int(os.environ.get("POOLS_PEER_SLOTS", "4"))}},
    "TASKS": {name: {"pools": "suite"} for name in _names},
    "SQL_FAST_PATH": os.environ.get("POOLS_PEER_FAST_PATH", "on") != "off",
}
