"""Admin registrations for pools and queue entries (changes go through the service functions).

Besides the model pages this module mounts the card's fragment and cancel views, the run
panel and a pool's occupancy page (see :mod:`pools_admin.views`) through ``get_urls``,
and adds "Run now" to django-celery-beat's ``PeriodicTask`` admin
(:func:`install_run_now`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import update_wrapper
from typing import Any

from django.contrib import admin, messages
from django.db import DatabaseError
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.urls import URLPattern, path, re_path, reverse
from django.utils.html import format_html

from pools import conf, pool_fields
from pools.core import admission, backoffs, overrides, pool_crud
from pools.core import capacity as pool_capacity
from pools.exceptions import PoolError, PoolRefused, PoolUnavailable
from pools.models import Pool, PoolEvent, PoolOverride, QueueEntry, WorkerNode
from pools.querysets import held_slots_expr, waiting_count_expr
from pools.states import HELD_STATES, EntryState
from pools_admin import views, why
from pools_admin.forms import PoolForm


def actor_of(request: HttpRequest) -> str:
    """The username logged as the actor of a change made in the admin."""
    user = getattr(request, "user", None)
    return str(user.get_username()) if user is not None and user.is_authenticated else ""


def _mount(model_admin: admin.ModelAdmin[Any], view: Callable[..., HttpResponse]) -> Any:
    """``view(request, model_admin, ...)`` as an admin view of ``model_admin``'s site."""

    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        return view(request, model_admin, *args, **kwargs)

    wrapped = model_admin.admin_site.admin_view(update_wrapper(wrapper, view))
    return wrapped


@admin.register(Pool)
class PoolAdmin(admin.ModelAdmin):
    form = PoolForm
    list_display = (
        "name",
        "configured",
        "capacity",
        "draining",
        "held",
        "waiting",
        "paused",
        "backoff_until",
        "max_queued",
        "overflow",
        "strategy",
        "rate",
        "defined_in_settings",
        "retiring",
        "occupancy",
    )
    list_filter = ("paused", "strategy", "defined_in_settings", "retiring")
    search_fields = ("name",)
    actions = ["pause_pools", "resume_pools", "end_backoffs", "remove_overrides"]
    change_form_template = "pools_admin/pool_change_form.html"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Pool]:
        # Held and waiting as correlated subqueries: one query for the whole list.
        queryset: QuerySet[Pool] = (
            super()
            .get_queryset(request)
            .annotate(held_slots=held_slots_expr(), waiting_count=waiting_count_expr())
        )
        return queryset

    @admin.display(description="slots")
    def configured(self, obj: Pool) -> int:
        """The capacity asked for (the pending one while the pool drains)."""
        return pool_capacity.configured_slots(obj)

    @admin.display(description="capacity", ordering="slots")
    def capacity(self, obj: Pool) -> int:
        """The capacity in effect for admission."""
        return obj.slots

    @admin.display(description="draining", boolean=True)
    def draining(self, obj: Pool) -> bool:
        """A capacity change waits for the entries queued before it."""
        return obj.pending_slots is not None

    @admin.display(description="held", ordering="held_slots")
    def held(self, obj: Pool) -> int:
        return int(getattr(obj, "held_slots", 0))

    @admin.display(description="waiting", ordering="waiting_count")
    def waiting(self, obj: Pool) -> int:
        return int(getattr(obj, "waiting_count", 0))

    @admin.display(description="occupancy")
    def occupancy(self, obj: Pool) -> str:
        url = reverse(f"{self.admin_site.name}:pools_pool_occupancy", args=[obj.name])
        return format_html('<a href="{}">timeline</a>', url)

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        pool = Pool.objects.filter(pk=object_id).first() if object_id.isdigit() else None
        context = {**(extra_context or {})}
        if pool is not None:  # links to its event log (with the permission) and timeline
            context["events_url"] = views.events_of(request, pool.name)
        return super().change_view(request, object_id, form_url, context)

    def get_readonly_fields(self, request: HttpRequest, obj: Pool | None = None) -> Any:
        # Entries name their pools: renaming would orphan them.
        if obj is None:
            return ("defined_in_settings",)
        return ("name", "defined_in_settings", "template", "limits")

    @admin.display(description="per-key limits")
    def limits(self, obj: Pool) -> str:
        """A per-key pool's overridden limits: "slots 8 (override; template 2)"."""
        if obj.template not in conf.get().TEMPLATES:
            return "-"
        labels = overrides.labels(overrides.detail(obj.template, overrides.current(obj.name)))
        return "; ".join(labels) or (
            "template values (a change of slots, rate or max queued here is kept as this "
            "key's override)"
        )

    def get_object(self, request: HttpRequest, object_id: str, from_field: Any = None) -> Any:
        obj = super().get_object(request, object_id, from_field)
        if obj is not None and obj.pending_slots is not None:
            # The form edits the configured capacity: the pending one while the pool drains.
            obj.slots = obj.pending_slots
        return obj

    def save_model(self, request: HttpRequest, obj: Pool, form: Any, change: bool) -> None:
        # Through the service functions: a capacity change drains (capacity.change_slots).
        data = {f: form.cleaned_data[f] for f in pool_fields.EDITABLE if f in form.cleaned_data}
        if change:
            changed = {f: v for f, v in data.items() if f in form.changed_data}
            saved = pool_crud.update_pool(obj.name, actor=actor_of(request), **changed)
        else:
            saved = pool_crud.create_pool(name=obj.name, actor=actor_of(request), **data)
        obj.pk = saved.pk
        obj.slots, obj.pending_slots = saved.slots, saved.pending_slots

    def delete_model(self, request: HttpRequest, obj: Pool) -> None:
        # Through the service: refused while entries wait or hold slots, and logged.
        try:
            pool_crud.delete_pool(obj.name, actor=actor_of(request))
        except PoolError as exc:
            self.message_user(request, str(exc), messages.ERROR)

    def get_deleted_objects(self, objs: Any, request: HttpRequest) -> Any:
        # The service deletes a pool with its finished history (demand rows that PROTECT
        # it) and refuses one with unfinished entries: confirm the pools themselves only.
        pools = list(objs)
        return [str(p) for p in pools], {"resource pools": len(pools)}, set(), []

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Pool]) -> None:
        for pool in queryset:
            self.delete_model(request, pool)

    def _set_paused(self, request: HttpRequest, queryset: QuerySet[Pool], paused: bool) -> None:
        actor = actor_of(request)
        changed = [
            p.name for p in queryset if pool_capacity.set_paused(p.name, paused, actor=actor)
        ]
        verb = "Paused" if paused else "Resumed"
        if changed:
            self.message_user(request, f"{verb} {', '.join(changed)}.", messages.SUCCESS)
        else:
            state = "paused" if paused else "running"
            self.message_user(request, f"Nothing to do: every selected pool is already {state}.")

    @admin.action(description="Pause selected pools (admit nothing)", permissions=["change"])
    def pause_pools(self, request: HttpRequest, queryset: QuerySet[Pool]) -> None:
        self._set_paused(request, queryset, True)

    @admin.action(description="Resume selected pools", permissions=["change"])
    def resume_pools(self, request: HttpRequest, queryset: QuerySet[Pool]) -> None:
        self._set_paused(request, queryset, False)

    @admin.action(description="End backoff of selected pools now", permissions=["change"])
    def end_backoffs(self, request: HttpRequest, queryset: QuerySet[Pool]) -> None:
        actor = actor_of(request)
        ended = [p.name for p in queryset if backoffs.end_early(p.name, actor=actor)]
        if ended:
            self.message_user(
                request, f"Ended the backoff of {', '.join(ended)}.", messages.SUCCESS
            )
        else:
            self.message_user(request, "Nothing to do: no selected pool is backing off.")

    @admin.action(
        description="Remove per-key overrides (back to the template's limits)",
        permissions=["change"],
    )
    def remove_overrides(self, request: HttpRequest, queryset: QuerySet[Pool]) -> None:
        names = [
            pool.name
            for pool in queryset
            if pool.template in conf.get().TEMPLATES and overrides.current(pool.name)
        ]
        done = _clear_overrides(self, request, names)
        if done:
            self.message_user(
                request, f"Back to the template's limits: {', '.join(done)}.", messages.SUCCESS
            )
        else:
            self.message_user(request, "Nothing to do: no selected pool has overrides.")

    def get_urls(self) -> list[URLPattern]:
        info = f"{self.opts.app_label}_{self.opts.model_name}"
        return [
            path("card/", _mount(self, views.card_fragment), name=f"{info}_card"),
            path(
                "occupancy/<str:name>/",
                _mount(self, views.pool_page),
                name=f"{info}_occupancy",
            ),
            *super().get_urls(),
        ]


class PoolFilter(admin.SimpleListFilter):
    """Entries that ask for one pool."""

    title = "pool"
    parameter_name = "pool"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(n, n) for n in Pool.objects.order_by("name").values_list("name", flat=True)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(demands__pool__name=value) if value else queryset


@admin.register(QueueEntry)
class QueueEntryAdmin(admin.ModelAdmin):
    list_display = (
        "queue_id",
        "task_name",
        "state",
        "pools",
        "priority",
        "enqueued_at",
        "worker",
        "origin",
        "panel",
    )
    list_filter = (
        PoolFilter,
        "state",
        ("task_name", admin.AllValuesFieldListFilter),
        "origin",
    )
    search_fields = ("key", "task_name", "debounce_key")
    readonly_fields = [f.name for f in QueueEntry._meta.fields]
    actions = ["cancel_entries", "cancel_and_terminate"]
    change_form_template = "pools_admin/entry_change_form.html"
    change_list_template = "pools_admin/entry_change_list.html"
    ordering = ("-queue_id",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        """``pools.cancel_queueentry``, as the card and the REST API's cancel endpoint."""
        return views.can_cancel(request.user)

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        context = {**(extra_context or {})}
        if not views.can_cancel(request.user):  # the cancel actions are not offered: say why
            context["cancel_hidden"] = views.CANCEL_HIDDEN
        return super().changelist_view(request, context)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Rows change only through the service functions (a deleted holder would leak slots).
        return False

    @admin.display(description="pools")
    def pools(self, obj: QueueEntry) -> str:
        return ", ".join(
            f"{name}\N{MULTIPLICATION SIGN}{slots}" for name, slots in sorted(obj.demand.items())
        )

    @admin.display(description="run")
    def panel(self, obj: QueueEntry) -> str:
        url = reverse(f"{self.admin_site.name}:pools_queueentry_panel", args=[obj.queue_id])
        return format_html('<a href="{}">panel</a>', url)

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        if request.method == "POST":
            # Read-only: saving the form would write the whole row outside the service
            # functions (over whatever a worker changed meanwhile). Use the actions.
            return HttpResponseNotAllowed(["GET", "HEAD"])
        context: dict[str, Any] = {
            "show_save": False,
            "show_save_and_continue": False,
            "show_save_and_add_another": False,
            "show_delete": False,
            **(extra_context or {}),
        }
        entry = QueueEntry.objects.filter(pk=object_id).first() if object_id.isdigit() else None
        if entry is not None:
            try:
                context["explanation"] = why.explain_one(entry)
            except (PoolUnavailable, DatabaseError) as exc:
                context["explanation_error"] = f"{views.UNAVAILABLE}: {exc}"
            context["panel_url"] = reverse(
                f"{self.admin_site.name}:pools_queueentry_panel", args=[entry.queue_id]
            )
        return super().change_view(request, object_id, form_url, context)

    def _cancel(
        self, request: HttpRequest, queryset: QuerySet[QueueEntry], terminate: bool
    ) -> None:
        done: list[str] = []
        states = (EntryState.WAITING, *HELD_STATES) if terminate else (EntryState.WAITING,)
        skipped = queryset.exclude(state__in=states).count()
        for entry in queryset.filter(state__in=states).order_by("queue_id"):
            try:
                admission.cancel(
                    entry.key,
                    reason=f"cancelled in the admin by {request.user}",
                    terminate=terminate,
                    actor=actor_of(request),
                )
            except PoolRefused as exc:
                self.message_user(request, str(exc), messages.WARNING)
            except (PoolUnavailable, DatabaseError):
                self.message_user(
                    request, f"{views.UNAVAILABLE}; nothing more was cancelled.", messages.ERROR
                )
                break
            except PoolError as exc:
                self.message_user(request, str(exc), messages.WARNING)
            else:
                done.append(f"#{entry.queue_id}")
                self.log_change(request, entry, "Cancelled" + (" (terminate)" if terminate else ""))
        if done:
            what = "Cancelled or stopping" if terminate else "Cancelled"
            self.message_user(request, f"{what}: {', '.join(done)}.", messages.SUCCESS)
        if skipped:
            why_not = "already finished" if terminate else "not waiting (use cancel-and-terminate)"
            self.message_user(
                request,
                f"{skipped} selected entr{'y was' if skipped == 1 else 'ies were'} {why_not}.",
                messages.WARNING,
            )

    @admin.action(description="Cancel selected waiting entries", permissions=["cancel"])
    def cancel_entries(self, request: HttpRequest, queryset: QuerySet[QueueEntry]) -> None:
        self._cancel(request, queryset, terminate=False)

    @admin.action(
        description="Cancel selected entries, terminating running ones", permissions=["cancel"]
    )
    def cancel_and_terminate(self, request: HttpRequest, queryset: QuerySet[QueueEntry]) -> None:
        self._cancel(request, queryset, terminate=True)

    def get_urls(self) -> list[URLPattern]:
        info = f"{self.opts.app_label}_{self.opts.model_name}"
        return [
            path("card/cancel/", _mount(self, views.card_cancel), name=f"{info}_card_cancel"),
            # A root id is a Celery task id, which may hold any character ("/", newlines).
            re_path(
                r"^run/(?P<root_id>[\s\S]+)/\Z", _mount(self, views.run_panel), name=f"{info}_run"
            ),
            path("<int:queue_id>/panel/", _mount(self, views.entry_panel), name=f"{info}_panel"),
            *super().get_urls(),
        ]


@admin.register(PoolOverride)
class PoolOverrideAdmin(admin.ModelAdmin):
    """Per-key overrides, kept by pool name (also of keys whose pool is retired or not yet
    created). Set on the pool's page or through the REST API; removed here through the
    service (the pool returns to its template's limits). Permissions of pool changes."""

    list_display = ("pool", "template", "shown", "actor", "updated_at")
    search_fields = ("pool",)
    readonly_fields = ("pool", "template", "values", "actor", "updated_at")
    actions = ["remove_selected"]

    @admin.display(description="overrides")
    def shown(self, obj: PoolOverride) -> str:
        labels = overrides.labels(overrides.detail(obj.template, obj.values))
        return "; ".join(labels) or str(obj.values)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return bool(request.user.has_perm("pools.view_pool"))

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # the action below removes them, through the service

    def has_remove_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("pools.change_pool"))

    @admin.action(
        description="Remove selected overrides (back to the template's limits)",
        permissions=["remove"],
    )
    def remove_selected(self, request: HttpRequest, queryset: QuerySet[PoolOverride]) -> None:
        done = _clear_overrides(self, request, [row.pool for row in queryset])
        if done:
            self.message_user(request, f"Removed the overrides of {', '.join(done)}.")


def _clear_overrides(
    model_admin: admin.ModelAdmin, request: HttpRequest, names: list[str]
) -> list[str]:
    """Remove the per-key overrides of ``names`` through the service; the names done
    (a refusal is reported per pool)."""
    actor = actor_of(request)
    done = []
    for name in names:
        try:
            overrides.clear_overrides(name, actor=actor)
        except PoolError as exc:
            model_admin.message_user(request, f"{name}: {exc}", messages.ERROR)
            continue
        done.append(name)
    return done


@admin.register(PoolEvent)
class PoolEventAdmin(admin.ModelAdmin):
    list_display = ("id", "at", "kind", "pool", "entry_id", "key", "token", "actor")
    list_filter = ("kind", "pool")
    search_fields = ("key", "actor")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(WorkerNode)
class WorkerNodeAdmin(admin.ModelAdmin):
    list_display = ("hostname", "pid", "started_at", "last_seen")


# --------------------------------------------------------------------------- Run now


@admin.action(description="Run now (through its pools)", permissions=["start_job"])
def run_now(
    modeladmin: admin.ModelAdmin[Any], request: HttpRequest, queryset: QuerySet[Any]
) -> None:
    """Start each selected periodic task now, as the REST ``jobs/<name>/start`` does."""
    from pools_admin import jobs

    for task in queryset.order_by("name"):
        level, text = jobs.run_now(task.name)
        modeladmin.message_user(request, text, level)


def _has_start_job_permission(self: admin.ModelAdmin, request: HttpRequest) -> bool:
    """``pools.start_job`` (the REST API's) or the change permission on periodic tasks."""
    return bool(request.user.has_perm("pools.start_job") or self.has_change_permission(request))


def install_run_now(site: admin.AdminSite | None = None) -> bool:
    """Add "Run now" to the ``PeriodicTask`` admin registered on ``site`` (idempotent).

    The registered ModelAdmin (django-celery-beat's, or a project's own) is replaced by a
    subclass of it with one more action. Returns False while ``PeriodicTask`` is not
    registered yet (django-celery-beat not installed, or its admin not loaded yet).
    """
    site = site or admin.site
    try:
        from django_celery_beat.models import PeriodicTask
    except (ImportError, RuntimeError):  # not installed
        return False
    current = site._registry.get(PeriodicTask)
    if current is None:
        return False
    if getattr(current, "pools_run_now", False):
        return True
    base = type(current)
    actions = [*(base.actions or []), "run_now"]
    subclass = type(
        base.__name__,
        (base,),
        {
            "__module__": base.__module__,
            "__doc__": base.__doc__,
            "pools_run_now": True,
            "has_start_job_permission": _has_start_job_permission,
            "actions": actions,
            "run_now": run_now,
        },
    )
    site.unregister(PeriodicTask)
    site.register(PeriodicTask, subclass)
    return True


install_run_now()

__all__ = ["PoolAdmin", "QueueEntryAdmin", "install_run_now", "run_now"]
