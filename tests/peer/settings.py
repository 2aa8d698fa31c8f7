"""Django settings of the peer-suite runs: every task of Celery's suite pooled by name.

``POOLS_PEER_SLOTS`` is the capacity of the one pool ``suite``; ``POOLS_PEER_TASKS`` names
a JSON file listing the task names to pool (written by :mod:`tests.peer.run`).
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
CELERY_DB_REUSE_MAX = 1000

_tasks_file = os.environ.get("POOLS_PEER_TASKS")
_names: list[str] = json.loads(open(_tasks_file).read()) if _tasks_file else []
POOLS = {
    "DEFINITIONS": {"suite": {"slots": int(os.environ.get("POOLS_PEER_SLOTS", "4"))}},
    "TASKS": {name: {"pools": "suite"} for name in _names},
}
