"""REST endpoints. Every change goes through the service functions of the core.

Reads run in a transaction bounded like every pool operation (``LOCK_TIMEOUT_SECONDS``):
a table locked by a migration or a stuck session answers 503 at the bound instead of
hanging the request.

Authentication: the project's ``DEFAULT_AUTHENTICATION_CLASSES`` (DRF's default: session,
with CSRF, and basic), plus token authentication when ``rest_framework.authtoken`` is
installed. Permissions: Django model permissions per method (:mod:`pools.api.permissions`).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from django.apps import apps
from rest_framework import serializers, status
from rest_framework.authentication import TokenAuthentication
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.settings import api_settings
from rest_framework.views import APIView

from pools.api import errors, permissions
from pools.api import serializers as s
from pools.api.schema import OpenApiParameter, OpenApiResponse, extend_schema, view_schema
from pools.celery import jobs
from pools.core import (
    admission,
    backoffs,
    capacity,
    entry_pages,
    explain,
    overrides,
    pool_crud,
    reads,
    snapshots,
)
from pools.exceptions import EntryNotFound, PoolRefused, UnknownPool
from pools.models import Pool
from pools.states import Origin

#: Head entries per pool in ``GET pools/`` and ``GET pools/<name>/``.
LIST_HEAD, DETAIL_HEAD = 5, 10
#: Recent terminal entries per pool in the same answers.
LIST_RECENT, DETAIL_RECENT = 5, 10
#: Default page size of ``GET pools/<name>/entries/``.
PAGE_SIZE = 50


def _authentication_classes() -> list[Any]:
    classes = list(api_settings.DEFAULT_AUTHENTICATION_CLASSES)
    if apps.is_installed("rest_framework.authtoken"):
        if not any(issubclass(c, TokenAuthentication) for c in classes):
            classes.append(TokenAuthentication)
    return classes


def _perms(read: str = permissions.VIEW, **methods: str) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {"GET": (read,), "HEAD": (read,), "OPTIONS": (read,)}
    out.update({m: (p,) for m, p in methods.items()})
    return out


def _error(description: str, serializer: Any = s.ErrorSerializer) -> Any:
    return OpenApiResponse(serializer, description=description)


#: Answers every endpoint may give.
COMMON = {
    401: _error("Not authenticated (with an authentication class that sends a challenge)."),
    403: _error("Not authenticated (session), missing permission, or CSRF check failed."),
    503: _error("Pool state is unavailable.", s.UnavailableSerializer),
}
#: The answers of an endpoint that reads a request body.
WITH_BODY = {
    **COMMON,
    415: _error("Unsupported media type: send the body as JSON (application/json)."),
}


class PoolsAPIView(APIView):
    """Base of the endpoints: authentication, permissions, JSON errors, the schema."""

    permission_classes = [permissions.ModelPerms]
    perms: dict[str, tuple[str, ...]] = _perms()
    schema = view_schema()

    def get_authenticators(self) -> list[Any]:
        """The project's authentication classes, plus token auth when authtoken is installed."""
        return [cls() for cls in _authentication_classes()]

    def get_exception_handler(self) -> Any:
        """Pool errors become JSON answers with stable codes (:mod:`pools.api.errors`)."""
        return errors.exception_handler


def _actor(request: Request) -> str:
    """The username logged as the actor of a change made through the API."""
    user = request.user
    return str(user.get_username()) if user is not None and user.is_authenticated else ""


def _pool_or_404(name: str) -> None:
    if not Pool.objects.filter(name=name).exists():
        raise UnknownPool(name)


# --------------------------------------------------------------------------- pools


class PoolListView(PoolsAPIView):
    """``GET pools/``: every pool; ``POST pools/``: create one."""

    perms = _perms(POST="pools.add_pool")

    @extend_schema(
        operation_id="pools_list",
        responses={200: s.PoolSnapshotSerializer(many=True), **COMMON},
        description="Every pool with its capacity, occupancy, head of line and recent "
        "terminal entries. A fixed number of queries whatever the depth of the lines.",
    )
    def get(self, request: Request) -> Response:
        """Snapshots of every pool, by name."""
        with reads.bounded_read("read pools"):
            snaps = snapshots.snapshot_all(head=LIST_HEAD, recent=LIST_RECENT)
        return Response(s.PoolSnapshotSerializer(snaps, many=True).data)

    @extend_schema(
        operation_id="pools_create",
        request=s.PoolInputSerializer,
        responses={
            201: s.PoolSnapshotSerializer,
            400: _error("Invalid fields (same rules as settings).", s.ValidationErrorSerializer),
            **WITH_BODY,
        },
    )
    def post(self, request: Request) -> Response:
        """Create a pool."""
        data = s.PoolInputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        pool = pool_crud.create_pool(**data.validated_data, actor=_actor(request))
        snap = snapshots.snapshot(pool.name, head=DETAIL_HEAD, recent=DETAIL_RECENT)
        return Response(s.PoolSnapshotSerializer(snap).data, status=status.HTTP_201_CREATED)


class PoolDetailView(PoolsAPIView):
    """``GET``, ``PATCH``, ``DELETE pools/<name>/``."""

    perms = _perms(PATCH="pools.change_pool", DELETE="pools.delete_pool")

    @extend_schema(
        operation_id="pools_retrieve",
        responses={200: s.PoolSnapshotSerializer, 404: _error("Unknown pool."), **COMMON},
    )
    def get(self, request: Request, name: str) -> Response:
        """One pool."""
        with reads.bounded_read(f"read pool {name}"):
            snap = snapshots.snapshot(name, head=DETAIL_HEAD, recent=DETAIL_RECENT)
        return Response(s.PoolSnapshotSerializer(snap).data)

    @extend_schema(
        operation_id="pools_partial_update",
        request=s.PoolInputSerializer(partial=True),
        responses={
            200: s.PoolSnapshotSerializer,
            400: _error("Invalid fields (same rules as settings).", s.ValidationErrorSerializer),
            404: _error("Unknown pool."),
            **WITH_BODY,
        },
    )
    def patch(self, request: Request, name: str) -> Response:
        """Change ``slots``, ``max_queued``, ``paused`` or ``description``."""
        pool = Pool.objects.filter(name=name).first()
        if pool is None:
            raise UnknownPool(name)
        data = s.PoolInputSerializer(pool, data=request.data, partial=True)
        data.is_valid(raise_exception=True)
        changes = {k: v for k, v in data.validated_data.items() if k != "name"}
        pool_crud.update_pool(name, actor=_actor(request), **changes)
        snap = snapshots.snapshot(name, head=DETAIL_HEAD, recent=DETAIL_RECENT)
        return Response(s.PoolSnapshotSerializer(snap).data)

    @extend_schema(
        operation_id="pools_destroy",
        responses={
            204: OpenApiResponse(description="Deleted."),
            404: _error("Unknown pool."),
            409: _error(
                "Entries still wait for or hold the pool (pool_in_use), or the pool is "
                "defined in settings (pool_defined_in_settings)."
            ),
            **COMMON,
        },
    )
    def delete(self, request: Request, name: str) -> Response:
        """Delete a pool made in the admin or the API, with no unfinished entries."""
        pool_crud.delete_pool(name, actor=_actor(request))
        return Response(status=status.HTTP_204_NO_CONTENT)


class _PauseView(PoolsAPIView):
    """Base of ``POST pools/<name>/pause`` and ``POST pools/<name>/resume``."""

    perms = _perms(POST="pools.change_pool")
    paused = True

    def post(self, request: Request, name: str) -> Response:
        """Pause or resume the pool (idempotent); answers the pool."""
        capacity.set_paused(name, self.paused)
        snap = snapshots.snapshot(name, head=DETAIL_HEAD, recent=DETAIL_RECENT)
        return Response(s.PoolSnapshotSerializer(snap).data)


_PAUSE_RESPONSES = {
    200: s.PoolSnapshotSerializer,
    404: _error("Unknown pool."),
    **COMMON,
}


class PoolPauseView(_PauseView):
    """``POST pools/<name>/pause``: the pool admits nothing; its entries keep their place."""

    paused = True

    @extend_schema(
        operation_id="pools_pause",
        request=None,
        responses=_PAUSE_RESPONSES,
        description="Pause the pool: it admits nothing, waiting entries keep their place, and "
        "with paused_policy 'reject' new submits are refused (pool_paused). Idempotent. The "
        "change is logged.",
    )
    def post(self, request: Request, name: str) -> Response:
        """Pause the pool."""
        return super().post(request, name)


class PoolResumeView(_PauseView):
    """``POST pools/<name>/resume``: admission runs again."""

    paused = False

    @extend_schema(
        operation_id="pools_resume",
        request=None,
        responses=_PAUSE_RESPONSES,
        description="Resume a paused pool: admission runs after the change commits. "
        "Idempotent. The change is logged.",
    )
    def post(self, request: Request, name: str) -> Response:
        """Resume the pool."""
        return super().post(request, name)


class PoolEndBackoffView(PoolsAPIView):
    """``POST pools/<name>/end-backoff``: resume a pool in backoff now."""

    perms = _perms(POST="pools.change_pool")

    @extend_schema(
        operation_id="pools_end_backoff",
        request=None,
        responses=_PAUSE_RESPONSES,
        description="End the pool's backoff now (a timed pause a task asked for with "
        "pools.Backoff): admission runs after the change commits. A pool paused by hand "
        "stays paused (use resume). Idempotent. The change is logged.",
    )
    def post(self, request: Request, name: str) -> Response:
        """End the pool's backoff."""
        backoffs.end_early(name, actor=_actor(request))
        snap = snapshots.snapshot(name, head=DETAIL_HEAD, recent=DETAIL_RECENT)
        return Response(s.PoolSnapshotSerializer(snap).data)


def _overrides_body(name: str) -> dict[str, Any]:
    body = overrides.describe(name)
    if body is None:
        raise UnknownPool(name)
    return body


_OVERRIDES_404 = _error("No template's pattern makes this name (not a per-key pool).")


class PoolOverridesView(PoolsAPIView):
    """``GET``, ``PATCH``, ``DELETE pools/<name>/overrides``: a per-key pool's own limits."""

    perms = _perms(PATCH="pools.change_pool", DELETE="pools.change_pool")

    @extend_schema(
        operation_id="pools_overrides_retrieve",
        responses={200: s.OverridesSerializer, 404: _OVERRIDES_404, **COMMON},
        description="The limits of a per-key pool (created or not yet) and where each comes "
        "from: an override set at runtime, the template's values callable, or the template.",
    )
    def get(self, request: Request, name: str) -> Response:
        """A per-key pool's limits."""
        with reads.bounded_read(f"read overrides of {name}"):
            body = _overrides_body(name)
        return Response(s.OverridesSerializer(body).data)

    @extend_schema(
        operation_id="pools_overrides_partial_update",
        request=s.OverridesInputSerializer,
        responses={
            200: s.OverridesSerializer,
            400: _error("Invalid values (same rules as settings).", s.ValidationErrorSerializer),
            404: _OVERRIDES_404,
            **WITH_BODY,
        },
        description="Override slots, rate or max_queued of one key's pool (merged with its "
        "other overrides). Kept by name: they survive the pool's retirement and a sync "
        "from settings. Applied at once to an existing pool (a new slots drains). Logged "
        "with the user.",
    )
    def patch(self, request: Request, name: str) -> Response:
        """Set overrides."""
        if overrides.pattern_of(name) is None:
            raise UnknownPool(name)
        data = s.OverridesInputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        overrides.set_overrides(name, data.validated_data, actor=_actor(request))
        return Response(s.OverridesSerializer(_overrides_body(name)).data)

    @extend_schema(
        operation_id="pools_overrides_destroy",
        parameters=[
            OpenApiParameter(
                "fields",
                str,
                required=False,
                description="Comma-separated limits to remove (slots,rate,max_queued); all "
                "when left out.",
            )
        ],
        responses={
            200: s.OverridesSerializer,
            400: _error("Unknown field.", s.ValidationErrorSerializer),
            404: _OVERRIDES_404,
            **COMMON,
        },
        description="Remove overrides: each field returns to the template's value (or its "
        "values callable's). Logged with the user.",
    )
    def delete(self, request: Request, name: str) -> Response:
        """Remove overrides."""
        if overrides.pattern_of(name) is None:
            raise UnknownPool(name)
        raw = request.query_params.get("fields")
        fields = [f.strip() for f in raw.split(",") if f.strip()] if raw else None
        overrides.clear_overrides(name, fields, actor=_actor(request))
        return Response(s.OverridesSerializer(_overrides_body(name)).data)


class PoolEntriesView(PoolsAPIView):
    """``GET pools/<name>/entries/``: a page of the pool's entries in one state."""

    @extend_schema(
        operation_id="pools_entries_list",
        parameters=[
            OpenApiParameter(
                "state",
                str,
                description="Entry state: waiting (default, in line order), delayed, admitted, "
                "running, or a terminal state.",
                enum=list(entry_pages.PAGE_STATES),
            ),
            OpenApiParameter("limit", int, description=f"Page size, 1-{entry_pages.MAX_PAGE}."),
            OpenApiParameter("cursor", str, description="The next_cursor of the previous page."),
        ],
        responses={
            200: s.EntriesPageSerializer,
            400: _error(
                "Invalid limit (per field), or state or cursor (invalid_cursor).",
                s.BadRequestSerializer,
            ),
            404: _error("Unknown pool."),
            **COMMON,
        },
    )
    def get(self, request: Request, name: str) -> Response:
        """One page (cursor pagination)."""
        state = request.query_params.get("state", "waiting")
        cursor = request.query_params.get("cursor") or None
        try:
            limit = int(request.query_params.get("limit", PAGE_SIZE))
        except ValueError as exc:
            raise ValidationError({"limit": ["limit must be an integer."]}) from exc
        if not 1 <= limit <= entry_pages.MAX_PAGE:
            raise ValidationError(
                {"limit": [f"limit must be between 1 and {entry_pages.MAX_PAGE}."]}
            )
        with reads.bounded_read(f"read pool {name}"):
            page = entry_pages.entries_page(name, state=state, cursor=cursor, limit=limit)
        next_url = None
        if page.next_cursor:
            query = urlencode({"state": state, "limit": limit, "cursor": page.next_cursor})
            next_url = request.build_absolute_uri(f"{request.path}?{query}")
        body = {
            "results": s.LineItemSerializer(page.items, many=True).data,
            "next": next_url,
            "next_cursor": page.next_cursor,
        }
        return Response(body)


# --------------------------------------------------------------------------- entries


class EntryDetailView(PoolsAPIView):
    """``GET entries/<key>/``: one entry and why it waits."""

    @extend_schema(
        operation_id="entries_retrieve",
        responses={200: s.ExplanationSerializer, 404: _error("Unknown key."), **COMMON},
        description="The latest entry with this key (the Celery task id) and, per pool it asks "
        "for, its position, blocked_by, a message and an ETA.",
    )
    def get(self, request: Request, key: str) -> Response:
        """The entry and its places."""
        with reads.bounded_read("read entry"):
            got = explain.explain_key(key)
        body = dict(s.EntrySerializer(got.entry).data)
        body["blocked_by"] = got.blocked_by
        body["eta"] = _datetime.to_representation(got.eta) if got.eta else None
        body["pools"] = s.PlaceSerializer(got.places, many=True).data
        return Response(body)


_datetime = serializers.DateTimeField()


class CancelView(PoolsAPIView):
    """``POST pools/<name>/queue/<key>/cancel``."""

    perms = _perms(POST=permissions.CANCEL)

    @extend_schema(
        operation_id="pools_queue_cancel",
        request=s.CancelSerializer,
        responses={
            200: s.EntrySerializer,
            400: _error(
                "Invalid body: terminate must be a boolean (per field), or unreadable JSON "
                "(parse_error).",
                s.BadRequestSerializer,
            ),
            404: _error("Unknown pool, or no entry with this key in the pool."),
            409: _error(
                "The pool refuses: the entry is already running (without terminate) or "
                "finished (not_cancellable)."
            ),
            **WITH_BODY,
        },
    )
    def post(self, request: Request, name: str, key: str) -> Response:
        """Cancel a waiting entry (or, with ``terminate``, stop a held one)."""
        body = s.CancelSerializer(data=request.data or {})
        body.is_valid(raise_exception=True)
        _pool_or_404(name)
        entry = explain.latest_entry(key)
        if name not in entry.demand:
            raise EntryNotFound(key)
        entry = admission.cancel(
            key,
            reason=f"cancelled via the API by {request.user}"[:255],
            terminate=body.validated_data["terminate"],
            actor=_actor(request),
        )
        return Response(s.EntrySerializer(entry).data)


# --------------------------------------------------------------------------- jobs


class JobStartView(PoolsAPIView):
    """``POST jobs/<name>/start``: start a periodic task now."""

    perms = _perms(POST=permissions.START_JOB)

    @extend_schema(
        operation_id="jobs_start",
        request=s.JobStartSerializer,
        responses={
            202: s.JobStartedSerializer,
            400: _error(
                "Invalid worker, or a worker given for a task that is not pooled "
                "(pool_configuration).",
                s.ValidationErrorSerializer,
            ),
            404: _error("Unknown periodic task (job_not_found)."),
            409: _error(
                "A pool refuses the task (pool_full, pool_draining, unknown_pool, "
                "demand_exceeds_capacity, message_too_large, ...)."
            ),
            **WITH_BODY,
        },
    )
    def post(self, request: Request, name: str) -> Response:
        """Send the job's task through the pools gate."""
        data = s.JobStartSerializer(data=request.data or {})
        data.is_valid(raise_exception=True)
        try:
            started = jobs.start_job(
                name, origin=Origin.MANUAL, worker=data.validated_data.get("worker", "")
            )
        except UnknownPool as exc:  # the task names a pool that is missing: a refusal here
            refused = PoolRefused(str(exc))
            refused.code = exc.code
            raise refused from exc
        body: dict[str, Any] = {"queued": started.queued, "key": started.key}
        if started.queued:
            body.update(
                queue_id=started.queue_id,
                pool=started.pool,
                pools=started.pools,
                existing=started.existing,
            )
        return Response(body, status=status.HTTP_202_ACCEPTED)
