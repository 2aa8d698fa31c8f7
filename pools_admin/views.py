"""Admin views: the card (and its fragment), cancel from the card, the run panel, a pool's page.

Every view is mounted by a ModelAdmin's ``get_urls`` and wrapped in
``admin_site.admin_view`` (staff login, ``never_cache``, CSRF), so a project includes
nothing beyond ``admin.site.urls``. Each checks a model permission of its own.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.db import DatabaseError
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from pools import permissions as perms
from pools.core import admission, rates, reads
from pools.exceptions import EntryNotFound, PoolRefused, PoolUnavailable
from pools.models import Pool, QueueEntry
from pools_admin import board, runs, timeline

if TYPE_CHECKING:
    from django.contrib.admin import ModelAdmin

logger = logging.getLogger(__name__)

#: Seconds between two refreshes of the card.
REFRESH_SECONDS = 5
#: What the card and the API say when the pool tables cannot be read.
UNAVAILABLE = "Pool state is unavailable"

VIEW_POOL = perms.VIEW_POOL
VIEW_ENTRY = perms.VIEW_ENTRY
VIEW_EVENT = perms.VIEW_EVENT
#: Cancel entries: the same permission as the REST API's cancel endpoint.
CANCEL_ENTRY = perms.CANCEL_ENTRY
#: Shown where the card and the entry list hide their Cancel controls.
CANCEL_HIDDEN = perms.missing("Cancelling entries", CANCEL_ENTRY)


def can_cancel(user: Any) -> bool:
    """The user may cancel entries (card, entry actions): ``pools.cancel_queueentry``."""
    return bool(user.has_perm(CANCEL_ENTRY))


def _url(request: HttpRequest, name: str, *args: Any) -> str:
    return reverse(
        f"admin:{name}", args=args, current_app=getattr(request, "current_app", None) or "admin"
    )


def card_context(request: HttpRequest) -> dict[str, Any]:
    """Context of the card for ``request.user``; ``{"card": None}`` without permission."""
    user = getattr(request, "user", None)
    if user is None or not user.has_perm(VIEW_POOL):
        return {"card": None}
    error = None
    rows: list[board.PoolRow] = []
    try:
        with reads.bounded_read("admin card"):  # a locked table: the condition, at the bound
            rows = board.load()
    except (PoolUnavailable, DatabaseError) as exc:
        logger.warning("pools card: %s: %s", UNAVAILABLE, exc)
        error = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return {
        "card": True,
        "request": request,
        "rows": rows,
        "totals": board.totals(rows),
        "error": error,
        "unavailable": UNAVAILABLE,
        "now": timezone.now(),
        "can_cancel": can_cancel(user),
        "cancel_hidden": CANCEL_HIDDEN,
        "can_view_entries": user.has_perm(VIEW_ENTRY),
        "events_url": _url(request, "pools_poolevent_changelist")
        if user.has_perm(VIEW_EVENT)
        else "",
        "refresh_url": _url(request, "pools_pool_card"),
        "cancel_url": _url(request, "pools_queueentry_card_cancel"),
        "entries_url": _url(request, "pools_queueentry_changelist"),
        "refresh_seconds": REFRESH_SECONDS,
    }


@require_GET
def card_fragment(request: HttpRequest, model_admin: ModelAdmin[Any]) -> HttpResponse:
    """The card's inner HTML, fetched by ``card.js`` every few seconds."""
    context = card_context(request)
    if context["card"] is None:
        raise PermissionDenied
    return TemplateResponse(request, "pools_admin/card_body.html", context)


def _wants_json(request: HttpRequest) -> bool:
    return "application/json" in request.headers.get("Accept", "")


@require_POST
def card_cancel(request: HttpRequest, model_admin: ModelAdmin[Any]) -> HttpResponse:
    """Cancel one waiting entry (``key`` in the POST body) from the card.

    Answers JSON ``{"ok", "message"}`` to ``card.js`` (200, 404, 409 with the pool's own
    message, 503) and a redirect to the admin index with a message otherwise (no JS).
    """
    if not can_cancel(request.user):
        raise PermissionDenied
    key = request.POST.get("key", "").strip()
    status, level = 200, messages.SUCCESS
    try:
        if not key:
            raise EntryNotFound(key)
        entry = admission.cancel(
            key,
            reason=f"cancelled in the admin by {request.user}",
            actor=request.user.get_username(),
        )
    except EntryNotFound as exc:
        status, level, text = 404, messages.ERROR, str(exc)
    except PoolRefused as exc:  # the pool's own message (already running, finished, ...)
        status, level, text = 409, messages.WARNING, str(exc)
    except (PoolUnavailable, DatabaseError) as exc:
        logger.warning("pools card cancel of %r: %s: %s", key, UNAVAILABLE, exc)
        status, level, text = 503, messages.ERROR, f"{UNAVAILABLE}; nothing was cancelled."
    else:
        text = f"Cancelled {entry.task_name} #{entry.queue_id} ({key})."
        model_admin.log_change(request, entry, f"Cancelled from the Resource pools card: {key}")
    if _wants_json(request):
        return JsonResponse({"ok": status == 200, "message": text}, status=status)
    messages.add_message(request, level, text)
    return HttpResponseRedirect(_url(request, "index"))


def _page(
    request: HttpRequest, model_admin: ModelAdmin[Any], template: str, **context: Any
) -> TemplateResponse:
    base = {
        **model_admin.admin_site.each_context(request),
        "opts": model_admin.model._meta,
        "windows": list(timeline.WINDOWS),
        **context,
    }
    return TemplateResponse(request, template, base)


@require_GET
def run_panel(request: HttpRequest, model_admin: ModelAdmin[Any], root_id: str) -> HttpResponse:
    """Every task of the workflow run ``root_id``, and its pools' occupancy timelines."""
    if not request.user.has_perm(VIEW_ENTRY):
        raise PermissionDenied
    panel = runs.load(root_id, window=request.GET.get("window"))
    if not panel.total:
        raise Http404(f"No queue entry belongs to run {root_id!r}.")
    return _run_page(request, model_admin, panel, root_id, title=f"Run {root_id}")


@require_GET
def entry_panel(request: HttpRequest, model_admin: ModelAdmin[Any], queue_id: int) -> HttpResponse:
    """The run panel around one entry (the entry alone when it is not part of a workflow)."""
    if not request.user.has_perm(VIEW_ENTRY):
        raise PermissionDenied
    entry = get_object_or_404(QueueEntry, pk=queue_id)
    root_id = entry.root_id or entry.key
    panel = runs.load(root_id, window=request.GET.get("window"), focus=entry)
    title = f"{entry.task_name} #{entry.queue_id}"
    return _run_page(request, model_admin, panel, root_id, title=title, focus=entry)


def _run_page(
    request: HttpRequest,
    model_admin: ModelAdmin[Any],
    panel: Any,
    root_id: str,
    *,
    title: str,
    focus: QueueEntry | None = None,
) -> HttpResponse:
    """The run panel page (a whole run, or the run around ``focus``)."""
    return _page(
        request,
        model_admin,
        "pools_admin/run_panel.html",
        title=title,
        windows=[*timeline.WINDOWS, runs.FIT],
        panel=panel,
        root_id=root_id,
        focus=focus,
    )


@require_GET
def pool_page(request: HttpRequest, model_admin: ModelAdmin[Any], name: str) -> HttpResponse:
    """One pool's occupancy timeline and its recent terminal entries."""
    if not request.user.has_perm(VIEW_POOL):
        raise PermissionDenied
    pool = get_object_or_404(Pool, name=name)
    page = runs.load_pool(pool, window=request.GET.get("window"))
    return _page(
        request,
        model_admin,
        "pools_admin/pool_page.html",
        title=f"Pool {pool.name}: occupancy",
        page=page,
        pool=pool,
        unlimited=pool.slots >= rates.UNLIMITED_SLOTS,
        events_url=events_of(request, pool.name),
    )


def events_of(request: HttpRequest, pool: str) -> str:
    """The admin's event list filtered by ``pool``; empty without the view permission."""
    if not request.user.has_perm(VIEW_EVENT):
        return ""
    return f"{_url(request, 'pools_poolevent_changelist')}?{urlencode({'pool': pool})}"
