"""Permissions: an authenticated user with the Django model permissions of each method."""

from __future__ import annotations

from typing import Any

from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from pools import permissions as perms

#: Read the pools, their lines and entries.
VIEW = perms.VIEW_POOL
#: Cancel entries (``POST pools/<name>/queue/<key>/cancel``), as on the card and the admin.
CANCEL = perms.CANCEL_ENTRY
#: Read the event log (``GET events/``), as the admin's event list.
VIEW_EVENT = perms.VIEW_EVENT
#: Start a periodic task now (``POST jobs/<name>/start``).
START_JOB = perms.START_JOB


class ModelPerms(BasePermission):
    """The user must be authenticated and hold ``view.perms[request.method]`` (all of them).

    A method the view does not implement is let through for an authenticated user so that
    it answers 405 (nothing runs); a method it implements without a permission is refused.
    """

    message = "You do not have the permission this endpoint needs."

    def has_permission(self, request: Request, view: Any) -> bool:
        """True for an active, authenticated user holding every permission of the method."""
        user = request.user
        if not user or not user.is_authenticated:
            return False
        method = (request.method or "").lower()
        if method not in view.http_method_names or not hasattr(view, method):
            return True  # nothing runs: the view answers 405 Method Not Allowed
        needed = view.perms.get(request.method, ())
        lacking = [perm for perm in needed if not user.has_perm(perm)]
        if lacking:  # the 403 names the permission (instance per request: no leak)
            self.message = perms.missing("This endpoint", lacking[0])
        return bool(needed) and not lacking
