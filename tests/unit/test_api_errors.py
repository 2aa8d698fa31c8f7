"""REST error mapping (no database): each PoolError to its status and JSON body."""

from __future__ import annotations

import pytest
from django.db import OperationalError
from rest_framework import exceptions
from rest_framework.response import Response

from pools.api import errors
from pools.core.entry_pages import InvalidCursor
from pools.exceptions import (
    DemandExceedsCapacity,
    EntryNotFound,
    JobNotFound,
    NotCancellable,
    PoolConfigurationError,
    PoolDefinedInSettings,
    PoolDraining,
    PoolError,
    PoolFull,
    PoolInUse,
    PoolPaused,
    PoolUnavailable,
    UnknownPool,
)


def handle(exc: Exception) -> Response:
    """The response the API's exception handler gives for ``exc`` (one it handles)."""
    response = errors.exception_handler(exc, {})
    assert response is not None, f"{exc!r} was not handled"
    return response


CASES = [
    (EntryNotFound("k"), 404, "entry_not_found"),
    (UnknownPool("p"), 404, "unknown_pool"),
    (JobNotFound("j"), 404, "job_not_found"),
    (PoolFull("p", 3), 409, "pool_full"),
    (PoolDraining("p", 2, 5), 409, "pool_draining"),
    (PoolPaused("p"), 409, "pool_paused"),
    (NotCancellable("Entry 'k' is already running."), 409, "not_cancellable"),
    (DemandExceedsCapacity("p", 3, 2), 409, "demand_exceeds_capacity"),
    (PoolInUse("p", 2), 409, "pool_in_use"),
    (PoolDefinedInSettings("p"), 409, "pool_defined_in_settings"),
    (PoolConfigurationError("Bad."), 400, "pool_configuration"),
]


@pytest.mark.parametrize("exc,status,code", CASES, ids=[c[2] for c in CASES])
def test_pool_errors__status_and_body(exc: PoolError, status: int, code: str) -> None:
    response = handle(exc)
    assert response.status_code == status
    assert response.data == {"detail": str(exc), "code": code}


def test_unavailable__fixed_body_whatever_the_cause() -> None:
    for exc in (
        PoolUnavailable("pool state is unavailable (pools p): lock timeout"),
        OperationalError("could not connect to server"),
    ):
        response = handle(exc)
        assert (response.status_code, response.data) == (503, {"detail": errors.UNAVAILABLE})


def test_configuration_error_on_one_field__is_a_field_message() -> None:
    exc = PoolConfigurationError("slots must be a positive integer, got 0.")
    exc.field = "slots"
    response = handle(exc)
    assert (response.status_code, response.data) == (400, {"slots": [str(exc)]})


def test_drf_errors__keep_their_status_and_get_a_code() -> None:
    response = handle(exceptions.PermissionDenied())
    assert response.status_code == 403 and response.data["code"] == "permission_denied"
    response = handle(InvalidCursor("Invalid cursor 'x'."))
    assert response.status_code == 400 and response.data["code"] == "invalid_cursor"
    assert errors.exception_handler(ValueError("a bug"), {}) is None, "bugs stay 500s"
