"""``GET events/``: the event log (the audit trail), newest first, in cursor pages.

The same rows as the admin's event list, for the same permission
(``pools.view_poolevent``), filtered by pool, entry key, actor, kind and time.
"""

from __future__ import annotations

import base64
import binascii
import json
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from django.db.models import QuerySet
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from pools.api import permissions
from pools.api import serializers as s
from pools.api.schema import OpenApiParameter, extend_schema
from pools.api.views import COMMON, PoolsAPIView, _error, _perms
from pools.core import reads
from pools.core.entry_pages import InvalidCursor
from pools.models import PoolEvent
from pools.states import EventKind

#: Default and largest page size.
PAGE_SIZE, MAX_PAGE = 50, 500
#: Query parameters matched exactly against the column of the same name.
EXACT = ("pool", "key", "actor")


class EventSerializer(serializers.ModelSerializer[PoolEvent]):
    """One row of the event log."""

    entry_id = serializers.IntegerField(
        allow_null=True, help_text="The entry's queue id (null for a pool change)."
    )
    actor = serializers.CharField(
        help_text="The username of whoever made the change in the admin or the API; empty "
        "for the engine's own transitions, settings sync and code."
    )

    class Meta:
        model = PoolEvent
        fields = ("id", "at", "kind", "pool", "entry_id", "key", "token", "actor", "detail")


class EventsPageSerializer(serializers.Serializer[Any]):
    """A page of the event log, newest first."""

    results = EventSerializer(many=True)
    next = serializers.CharField(allow_null=True, help_text="URL of the next page, or null.")
    next_cursor = serializers.CharField(allow_null=True)


def encode_cursor(before_id: int) -> str:
    """The cursor of the page that starts below event ``before_id``."""
    raw = json.dumps(["events", before_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> int:
    """The event id a cursor of :func:`encode_cursor` points below; :class:`InvalidCursor`."""
    try:
        values = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError) as exc:
        raise InvalidCursor(f"Invalid cursor {cursor!r}: use the next cursor of a page.") from exc
    if (
        not isinstance(values, list)
        or len(values) != 2
        or values[0] != "events"
        or not isinstance(values[1], int)
        or isinstance(values[1], bool)
    ):
        raise InvalidCursor(f"Cursor {cursor!r} is not a cursor of the event log.")
    return values[1]


def _when(params: Any, name: str) -> datetime | None:
    text = params.get(name)
    if not text:
        return None
    try:
        value = parse_datetime(text)
    except ValueError:
        value = None
    if value is None:
        raise ValidationError({name: [f"{name} must be an ISO 8601 date and time."]})
    if timezone.is_naive(value):
        value = timezone.make_aware(value, timezone.get_default_timezone())
    return value


def _limit(params: Any) -> int:
    try:
        limit = int(params.get("limit", PAGE_SIZE))
    except ValueError as exc:
        raise ValidationError({"limit": ["limit must be an integer."]}) from exc
    if not 1 <= limit <= MAX_PAGE:
        raise ValidationError({"limit": [f"limit must be between 1 and {MAX_PAGE}."]})
    return limit


def filtered(params: Any) -> QuerySet[PoolEvent]:
    """The rows the query parameters select (``ValidationError`` for a bad value)."""
    rows = PoolEvent.objects.all()
    for name in EXACT:
        value = params.get(name)
        if value and "\x00" in value:  # no column holds one (PostgreSQL refuses to compare)
            raise ValidationError({name: [f"{name} must not contain a NUL character."]})
        if value:
            rows = rows.filter(**{name: value})
    kinds = [k for k in params.getlist("kind") if k]
    unknown = sorted(set(kinds) - set(EventKind.values))
    if unknown:
        known = ", ".join(EventKind.values)
        raise ValidationError({"kind": [f"Unknown kind {unknown[0]!r}; use one of {known}."]})
    if kinds:
        rows = rows.filter(kind__in=kinds)
    since, until = _when(params, "since"), _when(params, "until")
    if since is not None:
        rows = rows.filter(at__gte=since)
    if until is not None:
        rows = rows.filter(at__lt=until)
    return rows


class EventListView(PoolsAPIView):
    """``GET events/``: the event log, newest first (cursor pagination)."""

    perms = _perms(read=permissions.VIEW_EVENT)

    @extend_schema(
        operation_id="events_list",
        parameters=[
            OpenApiParameter("pool", str, description="Only this pool's events (exact name)."),
            OpenApiParameter("key", str, description="Only the events of this entry key."),
            OpenApiParameter("actor", str, description="Only changes made by this username."),
            OpenApiParameter(
                "kind",
                str,
                many=True,
                enum=list(EventKind.values),
                description="Only these kinds (repeat the parameter for several).",
            ),
            OpenApiParameter("since", str, description="Events at or after this ISO 8601 time."),
            OpenApiParameter("until", str, description="Events before this ISO 8601 time."),
            OpenApiParameter("limit", int, description=f"Page size, 1-{MAX_PAGE}."),
            OpenApiParameter("cursor", str, description="The next_cursor of the previous page."),
        ],
        responses={
            200: EventsPageSerializer,
            400: _error(
                "Invalid limit, kind, since or until (per field), or cursor (invalid_cursor).",
                s.BadRequestSerializer,
            ),
            **COMMON,
        },
        description="The event log (audit trail): pool changes with their actor, "
        "cancellations, terminations, requeues, expiries and other rare transitions, newest "
        "first. Rows older than RETENTION_SECONDS are pruned. Needs pools.view_poolevent, "
        "as the admin's event list.",
    )
    def get(self, request: Request) -> Response:
        """One page of the event log."""
        params = request.query_params
        limit = _limit(params)
        cursor = params.get("cursor") or None
        rows = filtered(params)
        if cursor:
            rows = rows.filter(id__lt=decode_cursor(cursor))
        with reads.bounded_read("read events"):
            page = list(rows.order_by("-id")[: limit + 1])
        more, page = len(page) > limit, page[:limit]
        next_cursor = encode_cursor(page[-1].id) if more else None
        next_url = None
        if next_cursor:
            # Every filter and the limit kept, the cursor replaced.
            query = [(k, v) for k, values in params.lists() if k != "cursor" for v in values]
            next_url = request.build_absolute_uri(
                f"{request.path}?{urlencode([*query, ('cursor', next_cursor)])}"
            )
        body = {
            "results": EventSerializer(page, many=True).data,
            "next": next_url,
            "next_cursor": next_cursor,
        }
        return Response(body)
