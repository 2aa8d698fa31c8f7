"""The REST API (Django REST framework): the only package of ``pools`` that imports DRF.

Mount it with ``path("api/", include("pools.urls"))``; the paths, status codes and bodies
are documented in ``docs/reference/rest.md`` and in the OpenAPI schema (drf-spectacular,
the optional ``api`` extra).
"""
