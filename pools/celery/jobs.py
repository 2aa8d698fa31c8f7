"""Manual start of a django-celery-beat periodic task ("Run now"), through the pools gate.

Used by the REST endpoint ``POST jobs/<name>/start`` and the admin's "Run now". The
periodic task's task is sent the way beat sends it (its args, kwargs and queue options,
the ``periodic_task_name`` header), with ``app.send_task``, so a pooled task becomes a
queue entry like any other call; the origin is recorded as a manual start.

Celery and django-celery-beat are imported inside :func:`start_job`: this module is glue,
and importing it does not pull Celery into the core.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from celery import current_app
from celery.utils import uuid

from pools.celery import refusals
from pools.celery.messages import CALL_OPTION, ORIGIN_OPTION
from pools.celery.task_specs import spec_for
from pools.exceptions import JobNotFound, PoolConfigurationError, PoolError
from pools.models import QueueEntry
from pools.states import Origin


@dataclass(frozen=True, kw_only=True)
class JobStarted:
    """Outcome of :func:`start_job`."""

    #: True when the task is pooled: it went in line (it may already be admitted).
    queued: bool
    #: The Celery task id of the call.
    key: str
    #: The queue entry's id (pooled tasks only).
    queue_id: int | None = None
    #: The first pool the task asks for, by name (pooled tasks only).
    pool: str | None = None
    #: Every pool the task asks for, by name.
    pools: list[str] = field(default_factory=list)
    #: True when nothing new was queued: an unfinished entry of the job (``skip``) or with
    #: the same idempotency key exists, and ``key`` / ``queue_id`` are that entry's.
    existing: bool = False


def _json_field(raw: str | None, default: Any, name: str, what: str) -> Any:
    try:
        return json.loads(raw) if raw else default
    except ValueError as exc:
        raise PoolConfigurationError(
            f"Periodic task {name!r} has invalid JSON in its {what}: {exc}. Fix it in the admin."
        ) from exc


def start_job(name: str, *, origin: Origin = Origin.MANUAL, worker: str = "") -> JobStarted:
    """Send periodic task ``name``'s task now, through the pools gate.

    ``worker`` (a Celery hostname) pins the call to that worker (node affinity, pooled
    tasks only): it runs there and nowhere else, and waits while that worker is down.

    Raises :class:`JobNotFound` for an unknown name; a pool's refusal propagates
    (:class:`PoolFull`, :class:`PoolDraining`, ...), as does :class:`PoolUnavailable`,
    after the warning ``Job <name> could not enter pool <pool>: <reason>`` on the
    ``pools`` logger (:mod:`pools.celery.refusals`).
    """
    from django_celery_beat.models import PeriodicTask

    job = PeriodicTask.objects.filter(name=name).first()
    if job is None:
        raise JobNotFound(name)
    args = _json_field(job.args, [], name, "args")
    kwargs = _json_field(job.kwargs, {}, name, "kwargs")
    headers = _json_field(job.headers, {}, name, "headers")
    headers["periodic_task_name"] = job.name  # what beat adds: the job a call belongs to
    options: dict[str, Any] = {"headers": headers, ORIGIN_OPTION: origin}
    for option in ("queue", "exchange", "routing_key", "priority"):
        value = getattr(job, option)
        if value is not None and value != "":
            options[option] = value
    if job.expires is not None:
        options["expires"] = job.expires
    elif job.expire_seconds is not None:
        options["expires"] = job.expire_seconds
    key = uuid()
    spec = spec_for(current_app, job.task)
    pooled = spec is not None
    if worker:
        if spec is None:
            raise PoolConfigurationError(
                f"Periodic task {name!r} runs {job.task}, which is not pooled: only a pooled "
                f"task can be pinned to a worker."
            )
        options[CALL_OPTION] = {"worker": worker}
    try:
        result = current_app.send_task(job.task, args, kwargs, task_id=key, **options)
    except PoolError as exc:  # refused or unreachable: nothing was queued
        if spec is not None:
            refusals.warn_dropped(job.name, refusals.pool_of(exc, spec.pools), exc)
        raise
    if not pooled:
        return JobStarted(queued=False, key=key)
    existing = result.id != key  # skip / idempotency key: the unfinished entry's id
    key = result.id
    entry = QueueEntry.objects.filter(key=key).order_by("-queue_id").only("demand", "state").first()
    names = sorted(entry.demand) if entry is not None else []
    if existing:
        state = "waiting" if entry is not None and entry.state == "waiting" else "running"
        refusals.warn_skipped(job.name, ", ".join(names), f"skipped: {job.name} is already {state}")
    return JobStarted(
        queued=True,
        key=key,
        queue_id=entry.queue_id if entry is not None else None,
        pool=names[0] if names else None,
        pools=names,
        existing=existing,
    )
