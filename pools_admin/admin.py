"""Admin registrations for pools and queue entries (actions call the service functions)."""

from __future__ import annotations

from django.contrib import admin

from pools.models import Pool, PoolEvent, QueueEntry


@admin.register(Pool)
class PoolAdmin(admin.ModelAdmin):
    list_display = ("name", "slots", "max_queued", "paused", "defined_in_settings")
    search_fields = ("name",)


@admin.register(QueueEntry)
class QueueEntryAdmin(admin.ModelAdmin):
    list_display = ("queue_id", "task_name", "state", "priority", "enqueued_at", "worker")
    list_filter = ("state", "demands__pool__name")
    search_fields = ("key", "task_name")
    readonly_fields = [f.name for f in QueueEntry._meta.fields]


@admin.register(PoolEvent)
class PoolEventAdmin(admin.ModelAdmin):
    list_display = ("id", "at", "kind", "pool", "entry_id", "token")
    list_filter = ("kind", "pool")
