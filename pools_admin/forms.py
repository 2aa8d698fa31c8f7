"""The admin's pool form: each field checked by the pool field table (:mod:`pools.pool_fields`),
the rules settings, the REST API and the pool services apply, with their messages."""

from __future__ import annotations

from typing import Any

from django import forms

from pools import pool_fields
from pools.exceptions import PoolConfigurationError
from pools.models import Pool


class PoolForm(forms.ModelForm):
    """Add and change a pool (saved through the pool services by ``PoolAdmin``)."""

    class Meta:
        model = Pool
        fields = pool_fields.names(pool_fields.CRUD)

    def clean(self) -> dict[str, Any]:
        """Check the fields the form shows with the table; values come back as stored."""
        cleaned: dict[str, Any] = super().clean() or {}
        for name in pool_fields.names(pool_fields.CRUD):
            if name not in cleaned or name in self.errors:
                continue  # not on the form (name on change), or refused already
            try:
                cleaned[name] = pool_fields.check(name, cleaned[name])
            except PoolConfigurationError as exc:
                self.add_error(name, str(exc))
        if "aging_seconds" in cleaned and "strategy" in cleaned:
            try:
                pool_fields.check_order(cleaned["strategy"], cleaned["aging_seconds"])
            except PoolConfigurationError as exc:
                self.add_error("aging_seconds", str(exc))
        return cleaned
