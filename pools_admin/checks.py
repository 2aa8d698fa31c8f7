"""System checks of the pools admin (ids ``pools_admin.W00x``)."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Warning, register

from pools_admin.index import INDEX_TEMPLATE


@register("admin")
def check_admin(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The card is on the admin index and "Run now" on the PeriodicTask admin."""
    from django.contrib import admin

    found: list[CheckMessage] = []
    if admin.site.index_template not in (None, INDEX_TEMPLATE):
        found.append(
            Warning(
                f"admin.site.index_template is {admin.site.index_template!r}: the Resource "
                f"pools card is not shown unless that template includes it.",
                hint="Add {% load pools_admin %}{% pools_card %} to your index template "
                "(inside {% block content %}), or silence pools_admin.W001.",
                id="pools_admin.W001",
            )
        )
    try:
        from django_celery_beat.models import PeriodicTask
    except (ImportError, RuntimeError):
        return found
    registered = admin.site._registry.get(PeriodicTask)
    if registered is not None and not getattr(registered, "pools_run_now", False):
        found.append(
            Warning(
                "'Run now' could not be added to the PeriodicTask admin.",
                hint="List 'pools_admin' after 'django.contrib.admin' in INSTALLED_APPS.",
                id="pools_admin.W002",
            )
        )
    return found
