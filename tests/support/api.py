"""Shared helpers of the REST API tests: users with permissions, clients, URLs."""

from __future__ import annotations

import itertools
from typing import Any

from django.contrib.auth.models import Permission, User
from rest_framework.test import APIClient

from tests.conftest import POOL_APPS

#: Apps whose tables the API tests flush (auth for users and permissions, authtoken).
API_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "rest_framework.authtoken",
    *POOL_APPS,
]

#: Every permission the API knows.
ALL_PERMS = (
    "pools.view_pool",
    "pools.add_pool",
    "pools.change_pool",
    "pools.delete_pool",
    "pools.cancel_queueentry",
    "pools.start_job",
    "pools.view_poolevent",
)

_names = itertools.count(1)


def make_user(*perms: str, staff: bool = False) -> User:
    """A user holding exactly ``perms`` (``app_label.codename``)."""
    user = User.objects.create_user(f"user{next(_names)}", password="pw", is_staff=staff)
    for perm in perms:
        app_label, codename = perm.split(".")
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label=app_label, codename=codename)
        )
    return User.objects.get(pk=user.pk)  # fresh permission cache


def client_for(*perms: str, csrf: bool = False) -> APIClient:
    """A session-authenticated client of a user with ``perms``."""
    client = APIClient(enforce_csrf_checks=csrf)
    client.force_login(make_user(*perms))
    return client


def url(path: str) -> str:
    """The URL of an API path (mounted under ``api/`` in tests/urls.py)."""
    return f"/api/{path}"


def error(response: Any) -> tuple[int, Any]:
    """Status and JSON body of an answer (every answer of the API is JSON)."""
    assert response["Content-Type"].startswith("application/json"), response["Content-Type"]
    return response.status_code, response.json()
