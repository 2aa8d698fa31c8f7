"""Admin registrations for pools and queue entries (changes go through the service functions)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from pools import admission, definitions
from pools.exceptions import PoolError
from pools.models import Pool, PoolEvent, QueueEntry, WorkerNode


@admin.register(Pool)
class PoolAdmin(admin.ModelAdmin):
    list_display = ("name", "slots", "max_queued", "paused", "defined_in_settings")
    search_fields = ("name",)

    def get_readonly_fields(self, request: HttpRequest, obj: Pool | None = None) -> Any:
        # Entries name their pools: renaming would orphan them.
        return ("name", "defined_in_settings") if obj else ("defined_in_settings",)

    def save_model(self, request: HttpRequest, obj: Pool, form: Any, change: bool) -> None:
        before = (
            Pool.objects.filter(pk=obj.pk).values("slots", "paused").first() if change else None
        )
        super().save_model(request, obj, form, change)
        definitions.pool_saved(
            obj,
            old_slots=before["slots"] if before else None,
            old_paused=before["paused"] if before else None,
        )


@admin.register(QueueEntry)
class QueueEntryAdmin(admin.ModelAdmin):
    list_display = ("queue_id", "task_name", "state", "priority", "enqueued_at", "worker")
    list_filter = ("state", "demands__pool__name")
    search_fields = ("key", "task_name")
    readonly_fields = [f.name for f in QueueEntry._meta.fields]
    actions = ["cancel_entries"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.action(description="Cancel selected waiting entries", permissions=["change"])
    def cancel_entries(self, request: HttpRequest, queryset: QuerySet[QueueEntry]) -> None:
        done = 0
        for entry in queryset.filter(state="waiting"):
            try:
                admission.cancel(entry.key, reason=f"cancelled in admin by {request.user}")
                done += 1
            except PoolError as exc:
                self.message_user(request, str(exc), messages.WARNING)
        self.message_user(request, f"Cancelled {done} waiting entr{'y' if done == 1 else 'ies'}.")


@admin.register(PoolEvent)
class PoolEventAdmin(admin.ModelAdmin):
    list_display = ("id", "at", "kind", "pool", "entry_id", "token")
    list_filter = ("kind", "pool")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(WorkerNode)
class WorkerNodeAdmin(admin.ModelAdmin):
    list_display = ("hostname", "pid", "started_at", "last_seen")
