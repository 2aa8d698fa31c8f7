"""App configuration: the Resource pools card on the admin index, and "Run now" on beat's jobs."""

from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _

from pools_admin.index import INDEX_TEMPLATE


class PoolsAdminConfig(AppConfig):
    """``pools_admin``: Django admin integration for resource pools.

    ``ready()`` points the default admin site's ``index_template`` at
    :data:`~pools_admin.index.INDEX_TEMPLATE` unless the project set one of its own (then add
    ``{% load pools_admin %}{% pools_card %}`` to it). Templates are looked up by name,
    so this works wherever ``pools_admin`` stands in ``INSTALLED_APPS``; the system check
    ``pools_admin.W001`` says when the card or "Run now" could not be installed.
    """

    name = "pools_admin"
    verbose_name = _("Resource pools admin")

    def ready(self) -> None:
        from django.contrib import admin

        from pools_admin import checks  # noqa: F401  (registers the checks)
        from pools_admin.admin import install_run_now

        if admin.site.index_template is None:
            admin.site.index_template = INDEX_TEMPLATE
        # When django_celery_beat's admin was loaded after ours (INSTALLED_APPS order).
        install_run_now(admin.site)
