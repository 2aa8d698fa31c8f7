"""The send side of the gate: a call to a pooled task is put in line instead of published.

:func:`gated_send_task` replaces ``Celery.send_task`` (:func:`pools.celery.gate.install`).
Every way of publishing a task in Celery (``delay``, ``apply_async``, canvas members,
``Task.retry``, beat, chain/callback dispatch on a worker) ends there. A call to a pooled
task becomes a waiting :class:`~pools.models.QueueEntry` holding the message, and an
``AsyncResult`` with the final task id is returned at once; any other call goes to
Celery's own ``send_task`` unchanged.
"""

from __future__ import annotations

import inspect
import json
from contextvars import ContextVar
from datetime import datetime
from typing import Any

from celery import Celery
from celery.utils import uuid
from celery.utils.nodenames import worker_direct

from pools.celery import caps, messages, originals, refusals
from pools.celery.default_pool import default_spec
from pools.celery.job_fields import ExistingEntry, JobFields, inherited, job_fields
from pools.celery.messages import (
    ADMITTED_OPTION,
    BUDGET_HEADER,
    CALL_OPTION,
    CLAIM_HEADER,
    ORIGIN_OPTION,
    RATED_HEADER,
)
from pools.celery.task_specs import spec_for
from pools.core import admission, definitions, locking
from pools.core.records import Submission
from pools.exceptions import PoolConfigurationError, PoolUnavailable, UnknownPool
from pools.models import Origin
from pools.specs import PoolSpec

#: While :mod:`pools.celery.fanout` collects a batch (``pools.enqueue_many``, a group's
#: members), a pooled call's submission joins it instead of taking a transaction of its own.
batch: ContextVar[list[Submission] | None] = ContextVar("pools_batch", default=None)


def gated_send_task(
    self: Celery, name: str, args: Any = None, kwargs: Any = None, **options: Any
) -> Any:
    """``Celery.send_task`` with the gate: a pooled call is enqueued, not published."""
    if options.pop(ADMITTED_OPTION, False):
        return originals.send_task(self, name, args, kwargs, **options)
    call_options = options.pop(CALL_OPTION, None)
    origin = options.pop(ORIGIN_OPTION, None)
    spec = spec_for(self, name, options.get("task_type"))
    if spec is None:
        spec = default_spec(self, name, args, kwargs, options)
    if spec is None:
        if call_options:
            raise PoolConfigurationError(
                f"pool_options given for task {name!r}, which is not pooled. Decorate it with "
                f"@pooled or list it in POOLS['TASKS']."
            )
        return originals.send_task(self, name, args, kwargs, **options)
    spec = spec.with_call_options(call_options)
    if spec.worker:
        _route_to_worker(self, spec.worker, options)
    beat_fire = refusals.is_beat_fire(options.get("headers"), origin)
    if beat_fire and not options.get("task_id"):
        options["task_id"] = uuid()  # what send_task would pick: the id of a dropped fire
    try:
        if spec.patterns:
            values = call_arguments(self, name, options.get("task_type"), args, kwargs)
            spec = spec.resolve(values, task=name)
        spec = spec.with_task_cap(name)
        # In the try: a failing job_key / idempotency_key callable drops a beat fire too.
        fields = job_fields(name, args, kwargs, spec, options.get("headers"))
        return _submit(self, name, args, kwargs, spec, options, origin, fields)
    except ExistingEntry as existing:
        # Nothing was queued: the caller gets the unfinished entry's result.
        if beat_fire:
            job = refusals.job_name(options.get("headers"), name)
            refusals.warn_skipped(job, ", ".join(spec.pools), existing.reason())
        return self.AsyncResult(existing.enqueued.key)
    except Exception as exc:
        refused = refusals.as_pool_error(exc, name)
        if refused is None:
            raise
        if beat_fire:  # dropped with one warning; beat goes on with its other jobs
            job = refusals.job_name(options.get("headers"), name)
            refusals.warn_dropped(job, refusals.pool_of(refused, spec.pools), refused)
            return self.AsyncResult(options["task_id"])
        if refused is exc:
            raise
        raise refused from exc


def _route_to_worker(app: Celery, worker: str, options: dict[str, Any]) -> None:
    """Send a pinned call to ``worker``'s direct queue (Celery's ``worker_direct``).

    Only that worker consumes the queue, so no other worker can run the entry. Nothing is
    declared on publish: admission publishes only while the worker has a live heartbeat,
    and a running worker with ``worker_direct`` has its queue bound.
    """
    if not app.conf.worker_direct:
        raise PoolConfigurationError(
            f"pool_options={{'worker': {worker!r}}} needs Celery's worker_direct setting "
            f"(CELERY_WORKER_DIRECT = True, or app.conf.worker_direct = True) on the workers "
            f"and the callers, so each worker consumes its own queue."
        )
    for key in ("exchange", "routing_key"):
        options.pop(key, None)
    options["queue"] = worker_direct(worker)
    options["declare"] = []


def call_arguments(
    app: Celery, name: str, task_type: Any, args: Any, kwargs: Any
) -> dict[str, Any]:
    """A call's arguments by parameter name, to format per-key pool names from.

    Positional arguments are bound to the task's parameter names (defaults included);
    keyword arguments count as given. Without the task (``send_task`` by name from a
    process that does not import it) only keyword arguments are known.
    """
    values: dict[str, Any] = dict(kwargs or {})
    task = task_type if task_type is not None else app._tasks.get(name)  # type: ignore[attr-defined]
    run = getattr(task, "run", None)
    if run is None:
        return values
    try:
        signature = inspect.signature(run)
        bound = signature.bind_partial(*(args or ()), **(kwargs or {}))
    except (TypeError, ValueError):  # no signature, or a call that does not fit it
        return values
    bound.apply_defaults()
    for param_name, value in bound.arguments.items():
        kind = signature.parameters[param_name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            values.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            values[param_name] = value
    return values


def _submit(
    app: Celery,
    name: str,
    args: Any,
    kwargs: Any,
    spec: PoolSpec,
    options: dict[str, Any],
    origin: Origin | None = None,
    fields: JobFields | None = None,
) -> Any:
    """Let Celery build the message as it would publish it, and put it in line instead.

    ``send_task`` runs unchanged (routing, headers, ``reply_to``, publish signals, the
    app's serializer) with a :class:`~pools.celery.messages.CapturingProducer`: its ``publish``
    enqueues the message. A refusal (``PoolFull``, ``PoolUnavailable``, ...) is raised
    from there, before ``after_task_publish``, just as a broker error would be.
    """
    dropped = (CLAIM_HEADER, BUDGET_HEADER, RATED_HEADER)
    for header in dropped:
        options.pop(header, None)
    headers = options.get("headers")
    if isinstance(headers, dict) and any(h in headers for h in dropped):
        options["headers"] = {k: v for k, v in headers.items() if k not in dropped}

    def enqueue(message: messages.HeldMessage) -> None:
        _enqueue_held(message, spec, origin, fields or JobFields())

    connection = options.pop("connection", None)
    given = options.pop("producer", None) or options.pop("publisher", None)
    if given is None and connection is not None:
        given = app.amqp.Producer(connection, auto_declare=False)
    if given is not None:
        capture = messages.CapturingProducer(given, enqueue)
        return originals.send_task(app, name, args, kwargs, producer=capture, **options)
    with app.producer_or_acquire(None) as real:
        capture = messages.CapturingProducer(real, enqueue)
        return originals.send_task(app, name, args, kwargs, producer=capture, **options)


def _enqueue_held(
    message: messages.HeldMessage, spec: PoolSpec, origin: Origin | None, fields: JobFields
) -> None:
    refusals.check_size(message.task_name, message.body)
    headers = message.headers
    headers.pop(CLAIM_HEADER, None)
    headers.pop(BUDGET_HEADER, None)
    headers.pop(RATED_HEADER, None)
    if origin is None:
        origin = Origin.BEAT if headers.get("periodic_task_name") else Origin.CODE
    try:
        fields = inherited(fields, message.task_id, int(headers.get("retries") or 0))
        if fields.job:
            headers[messages.JOB_HEADER] = fields.job
        args, kwargs = _display(message)
        expires = message.header_time("expires")
        stored: dict[str, Any] = {messages.OPTION_KEY: message.to_json()}
        if expires is not None:
            stored["expires"] = expires.isoformat()
        spec = caps.with_run_cap(spec, str(headers.get("root_id") or ""), message.task_id)
        sub = _submission(message, spec, origin, args, kwargs, stored, expires, fields)
        ensure_pools(spec)
        collecting = batch.get()
        if collecting is not None and origin == Origin.CODE:
            collecting.append(sub)  # enqueued with the rest of the batch (pools.celery.fanout)
            return
        try:
            enqueued = admission.enqueue(sub)
        except UnknownPool as exc:
            if exc.pool not in spec.templates and exc.pool not in spec.caps:
                raise
            # The sweep retired this idle per-key or cap pool between our check and now.
            ensure_pools(spec, again=True)
            enqueued = admission.enqueue(sub)
    except PoolUnavailable:
        locking.drop_broken_connection()
        raise
    if not enqueued.created:
        raise ExistingEntry(enqueued, fields)


def ensure_pools(spec: PoolSpec, *, again: bool = False) -> None:
    """Create the per-key pools of a resolved spec on first use (from their templates),
    and its task cap's pool."""
    for pool, pattern in spec.templates.items():
        definitions.ensure_pool(pool, pattern)
    caps.ensure_caps(spec, again=again)


def _submission(
    message: messages.HeldMessage,
    spec: PoolSpec,
    origin: Origin,
    args: Any,
    kwargs: Any,
    stored: dict[str, Any],
    expires: datetime | None,
    fields: JobFields | None = None,
) -> Submission:
    headers = message.headers
    fields = fields or JobFields()
    return Submission(
        key=message.task_id,
        task_name=message.task_name,
        spec=spec,
        args=args,
        kwargs=kwargs,
        options=stored,
        not_before=message.header_time("eta"),
        expires=expires,
        origin=origin,
        root_id=str(headers.get("root_id") or ""),
        parent_id=str(headers.get("parent_id") or ""),
        attempt=int(headers.get("retries") or 0),
        pinned_worker=spec.worker,
        job=fields.job,
        concurrency_policy=fields.policy,
        idempotency_key=fields.idempotency_key,
        fairness_key=fields.fairness_key,
        debounce=spec.debounce if fields.debounce_key is not None else None,
        debounce_key=fields.debounce_key,
    )


def _display(message: messages.HeldMessage) -> tuple[Any, Any]:
    """Arguments for the admin and the API: the call's own, or Celery's repr of them."""
    headers = message.headers
    plain_json = (
        message.content_type == "application/json"
        and "compression" not in headers
        and b'"__type__"' not in message.body  # kombu-typed values (bytes, datetimes...)
        and b"\\u0000" not in message.body  # PostgreSQL's jsonb holds no NUL character
    )
    if plain_json:
        try:
            args, kwargs, _ = json.loads(message.body)
            json.dumps([args, kwargs])
            return list(args), dict(kwargs)
        except (TypeError, ValueError):
            pass
    return str(headers.get("argsrepr") or ""), str(headers.get("kwargsrepr") or "")
