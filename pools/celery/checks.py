"""System checks of how the project runs Celery (``pools.W004`` to ``pools.W006``).

What a project made from Celery's Django guide can still get wrong without an error until
the first call: no Celery app loaded with Django (calls go to Celery's default app, which
does not read the ``CELERY_*`` settings), a broker whose transport package is not installed,
and a prefetch that lets a busy worker process sit on an admitted message.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from django.core.checks import CheckMessage, Warning, register

from pools.checks import celery_app

#: The Python package a kombu transport (or Celery result backend) of this URL scheme
#: imports, and the extra that installs it.
TRANSPORT_PACKAGES: dict[str, tuple[str, str]] = {
    "redis": ("redis", "django-celery-pools[redis]"),
    "rediss": ("redis", "django-celery-pools[redis]"),
    "sentinel": ("redis", "django-celery-pools[redis]"),
    "sqs": ("boto3", "celery[sqs]"),
    "mongodb": ("pymongo", "celery[mongodb]"),
}


@register()
def check_celery_app(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The project's Celery app: loaded with Django, its transports installed, prefetch 1."""
    app = celery_app()
    if app is None:
        return [
            Warning(
                "No Celery app was created when Django loaded: tasks called from Django "
                "processes (the web process, manage.py commands) go to Celery's default app, "
                "which does not read the CELERY_* settings (its broker is "
                "amqp://guest@localhost//), so pooled calls are sent where no worker listens.",
                id="pools.W004",
                hint="Create proj/celery.py as Celery's 'First steps with Django' shows and "
                "import it in proj/__init__.py: 'from .celery import app as celery_app'.",
            )
        ]
    messages: list[CheckMessage] = []
    for setting, url in (
        ("broker_url", app.conf.broker_url),
        ("result_backend", app.conf.result_backend),
    ):
        missing = _missing_package(url)
        if missing is not None:
            package, extra = missing
            messages.append(
                Warning(
                    f"The Celery app {app.main!r} has {setting} {_scheme(url)}://..., whose "
                    f"transport needs the Python package {package!r}, which is not installed: "
                    "the first call fails.",
                    id="pools.W005",
                    hint=f"pip install '{extra}'.",
                )
            )
    multiplier = app.conf.worker_prefetch_multiplier
    if multiplier != 1 and not app.conf.get("worker_disable_prefetch"):
        reserved = "no limit of" if multiplier == 0 else f"up to {multiplier}"
        messages.append(
            Warning(
                f"The Celery app {app.main!r} has worker_prefetch_multiplier {multiplier}: "
                f"a worker reserves {reserved} messages per process, so an admitted pooled "
                "call can wait behind a busy process while its slots are held (the pool "
                "looks full while the call does not run; the lease stays renewed).",
                id="pools.W006",
                hint="Set CELERY_WORKER_PREFETCH_MULTIPLIER = 1 in the Django settings (or "
                "CELERY_WORKER_DISABLE_PREFETCH = True where your Celery has it, on Redis); "
                "silence pools.W006 if these workers run no pooled task.",
            )
        )
    return messages


def _scheme(url: Any) -> str:
    return str(url).split("://", 1)[0].split("+", 1)[0].lower() if url else ""


def _missing_package(url: Any) -> tuple[str, str] | None:
    """(package, extra) when ``url``'s transport needs a package that is not installed."""
    if not isinstance(url, str) or "://" not in url:
        return None
    needed = TRANSPORT_PACKAGES.get(_scheme(url))
    if needed is None or importlib.util.find_spec(needed[0]) is not None:
        return None
    return needed
