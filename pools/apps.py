"""App configuration: installs the Celery gate and syncs settings-defined pools on migrate."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.db.models.signals import post_migrate
from django.utils.translation import gettext_lazy as _


class PoolsConfig(AppConfig):
    """``pools``: named resource pools for Celery tasks."""

    name = "pools"
    verbose_name = _("Resource pools")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from pools import checks  # noqa: F401  (registers the system checks)
        from pools.celery import beat, fanout, gate, tasks, worker  # noqa: F401  (signal handlers, tasks)
        from pools.celery import checks as celery_checks  # noqa: F401  (registers its checks)

        gate.install()
        fanout.install()
        beat.connect_signals()
        post_migrate.connect(_sync_after_migrate, sender=self, dispatch_uid="pools.sync")


def _sync_after_migrate(sender: AppConfig, using: str = "default", **kwargs: Any) -> None:
    from pools.celery import beat
    from pools.core import settings_sync

    if any(backwards for _, backwards in kwargs.get("plan") or ()):
        return  # migrated back: the schema is older than the models this code syncs through

    settings_sync.sync()
    beat.ensure_sweep_schedule()
