"""The Celery app of the test project, configured the usual Django way."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

app = Celery("tests")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

if os.environ.get("POOLS_TEST_SABOTAGE") == "no-fence-watchdog":
    # Sabotage twin of the network-partition test: the keeper's watchdog does nothing,
    # so a hanging renewal never fences the body (the behaviour before the watchdog).
    from typing import Any

    from celery import signals

    @signals.worker_process_init.connect(weak=False)
    def _sabotage_watchdog(**kwargs: Any) -> None:
        from pools.celery.keeper import LeaseKeeper

        LeaseKeeper.fence_overdue = lambda self, now=None: 0  # type: ignore[method-assign]
