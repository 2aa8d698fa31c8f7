"""URLs of the REST API: ``path("api/", include("pools.urls"))`` mounts it under any prefix."""

from __future__ import annotations

from django.urls import path, re_path

from pools.api import events, views

app_name = "pools"

#: A key is a Celery task id, which may hold any character ("/" and newlines too).
KEY = r"(?P<key>[\s\S]+)"

urlpatterns = [
    path("pools/", views.PoolListView.as_view(), name="pool-list"),
    path("pools/<str:name>/", views.PoolDetailView.as_view(), name="pool-detail"),
    path("pools/<str:name>/pause", views.PoolPauseView.as_view(), name="pool-pause"),
    path("pools/<str:name>/resume", views.PoolResumeView.as_view(), name="pool-resume"),
    path(
        "pools/<str:name>/end-backoff",
        views.PoolEndBackoffView.as_view(),
        name="pool-end-backoff",
    ),
    path("pools/<str:name>/overrides", views.PoolOverridesView.as_view(), name="pool-overrides"),
    path("pools/<str:name>/entries/", views.PoolEntriesView.as_view(), name="pool-entries"),
    re_path(
        rf"^pools/(?P<name>[^/]+)/queue/{KEY}/cancel\Z",
        views.CancelView.as_view(),
        name="entry-cancel",
    ),
    re_path(rf"^entries/{KEY}/\Z", views.EntryDetailView.as_view(), name="entry-detail"),
    path("jobs/<str:name>/start", views.JobStartView.as_view(), name="job-start"),
    path("events/", events.EventListView.as_view(), name="event-list"),
]
