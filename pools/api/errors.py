"""JSON errors: every :class:`~pools.exceptions.PoolError` mapped to a status and a body.

=====================================  ======  ==========================================
exception                              status  body
=====================================  ======  ==========================================
EntryNotFound, UnknownPool, JobNotFound  404   ``{"detail": message, "code": code}``
PoolRefused (PoolFull, PoolDraining,     409   ``{"detail": message, "code": code}``
PoolPaused, NotCancellable, ...)
PoolConfigurationError                   400   ``{field: [message]}`` or detail + code
PoolUnavailable, database unreachable    503   ``{"detail": "pool state is unavailable"}``
=====================================  ======  ==========================================

DRF's own errors keep their status and get a ``code`` beside their ``detail``. Credentials
the database refuses to look up (a NUL byte on PostgreSQL) are ``authentication_failed``.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import DataError, InterfaceError, OperationalError
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler
from rest_framework.views import set_rollback

from pools.core.entry_pages import InvalidCursor
from pools.exceptions import (
    EntryNotFound,
    JobNotFound,
    PoolConfigurationError,
    PoolError,
    PoolRefused,
    PoolUnavailable,
    UnknownPool,
)

logger = logging.getLogger("pools.api")

#: The fixed body of every 503 answer (see docs/reference/rest.md, Errors).
UNAVAILABLE = "pool state is unavailable"


def status_of(exc: PoolError) -> int:
    """The HTTP status of a pool error (the order matters: refusals may also be config errors)."""
    # DRF ships no type information: its status constants are typed here (ints).
    code: int = status.HTTP_500_INTERNAL_SERVER_ERROR
    if isinstance(exc, PoolUnavailable):
        code = status.HTTP_503_SERVICE_UNAVAILABLE
    elif isinstance(exc, PoolRefused):
        code = status.HTTP_409_CONFLICT
    elif isinstance(exc, EntryNotFound | UnknownPool | JobNotFound):
        code = status.HTTP_404_NOT_FOUND
    elif isinstance(exc, PoolConfigurationError):
        code = status.HTTP_400_BAD_REQUEST
    return code


def body_of(exc: PoolError) -> dict[str, Any]:
    """The JSON body of a pool error."""
    if isinstance(exc, PoolUnavailable):
        return {"detail": UNAVAILABLE}
    if isinstance(exc, PoolConfigurationError) and not isinstance(exc, PoolRefused) and exc.field:
        return {exc.field: [str(exc)]}
    return {"detail": str(exc), "code": exc.code}


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF exception handler of the pools API views (set on the views, not globally)."""
    request = context.get("request")
    if isinstance(exc, DataError) and request is not None and not hasattr(request, "_user"):
        # Raised while authenticating (DRF sets ``_user`` once it is done): credentials the
        # database refuses to look up, e.g. a NUL byte in a basic-auth name on PostgreSQL.
        failed = exceptions.AuthenticationFailed(
            "Invalid credentials: they contain characters the database refuses (a NUL byte)."
        )
        view = context.get("view")  # 401 with a challenge, else 403, as DRF decides
        header = view.get_authenticate_header(request) if view is not None else None
        if header:
            failed.auth_header = header
        else:
            failed.status_code = status.HTTP_403_FORBIDDEN
        exc = failed
    if isinstance(exc, OperationalError | InterfaceError):  # the database is unreachable
        logger.warning("pools API: %s", exc)
        exc = PoolUnavailable(str(exc))
    if isinstance(exc, PoolError):
        if isinstance(exc, PoolUnavailable):
            logger.warning("pools API answered 503: %s", exc)
        set_rollback()
        return Response(body_of(exc), status=status_of(exc))
    if isinstance(exc, InvalidCursor):
        return Response({"detail": str(exc), "code": "invalid_cursor"}, status=400)
    response = drf_exception_handler(exc, context)
    if (
        response is not None
        and isinstance(exc, exceptions.APIException)
        and isinstance(response.data, dict)
        and set(response.data) == {"detail"}
    ):
        response.data["code"] = getattr(exc.detail, "code", None) or exc.default_code
    return response
