from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class PoolsAdminConfig(AppConfig):
    """``pools_admin``: Django admin integration for resource pools."""

    name = "pools_admin"
    verbose_name = _("Resource pools admin")
