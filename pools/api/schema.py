"""OpenAPI annotations when drf-spectacular is installed (the ``api`` extra), no-ops otherwise."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    from drf_spectacular.openapi import AutoSchema
    from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
except ImportError:  # pragma: no cover - exercised only without the extra
    AutoSchema = None  # type: ignore[assignment,misc]

    def extend_schema(*args: Any, **kwargs: Any) -> Callable[[Any], Any]:  # type: ignore[misc]
        """No-op stand-in for ``drf_spectacular.utils.extend_schema``."""
        return lambda view: view

    def OpenApiResponse(*args: Any, **kwargs: Any) -> Any:  # type: ignore[no-redef]  # noqa: N802
        """No-op stand-in."""
        return None

    def OpenApiParameter(*args: Any, **kwargs: Any) -> Any:  # type: ignore[no-redef]  # noqa: N802
        """No-op stand-in."""
        return None


def view_schema() -> Any:
    """The schema object for a view: drf-spectacular's when installed, else DRF's default."""
    if AutoSchema is not None:
        return AutoSchema()
    from rest_framework.schemas import DefaultSchema

    return DefaultSchema()


__all__ = ["OpenApiParameter", "OpenApiResponse", "extend_schema", "view_schema"]
