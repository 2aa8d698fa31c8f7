"""Admin pages for django-celery-pools: pools, entries, dashboard card and run panel."""
