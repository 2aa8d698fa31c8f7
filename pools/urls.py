"""URLs of the REST API: ``path("api/", include("pools.urls"))`` mounts it under any prefix."""

from __future__ import annotations

from django.urls import path

from pools.api import views

app_name = "pools"

urlpatterns = [
    path("pools/", views.PoolListView.as_view(), name="pool-list"),
    path("pools/<str:name>/", views.PoolDetailView.as_view(), name="pool-detail"),
    path("pools/<str:name>/entries/", views.PoolEntriesView.as_view(), name="pool-entries"),
    path(
        "pools/<str:name>/queue/<str:key>/cancel",
        views.CancelView.as_view(),
        name="entry-cancel",
    ),
    path("entries/<str:key>/", views.EntryDetailView.as_view(), name="entry-detail"),
    path("jobs/<str:name>/start", views.JobStartView.as_view(), name="job-start"),
]
