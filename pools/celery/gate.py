"""Publish side of the gate: Celery glue between ``send_task`` and the admission core.

Every way of publishing a task in Celery (``delay``, ``apply_async``, canvas members,
``Task.retry``, beat, chain/callback dispatch on a worker) ends in
``Celery.send_task``. :func:`install` wraps that one method: a call to a pooled
task becomes a waiting :class:`~pools.models.QueueEntry` holding the message, and
an ``AsyncResult`` with the final task id is returned at once. When admission
grants the slots, :data:`bridge` publishes the held message with the same task id
and a ``pools_claim`` header (``"<entry id>:<fencing token>"``).
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from celery import Celery, signals
from celery.app import base as celery_base
from celery.utils import uuid
from celery.utils.nodenames import worker_direct
from django.utils import timezone

from pools import conf
from pools.celery import caps, messages, purge, refusals, results
from pools.celery.decorators import gate_task, spec_of
from pools.celery.messages import (
    ADMITTED_OPTION,
    BUDGET_HEADER,
    CALL_OPTION,
    CLAIM_HEADER,
    ORIGIN_OPTION,
)
from pools.core import admission, definitions, locking
from pools.core.locking import unavailable_on_error
from pools.core.records import BUDGET_OPTION, Admission, Enqueued, Finished, Submission
from pools.exceptions import PoolConfigurationError, PoolUnavailable, UnknownPool
from pools.models import QueueEntry
from pools.specs import PoolSpec, resolve_key
from pools.states import ConcurrencyPolicy, Origin

#: Prefix of the idempotency key a ``skip`` entry takes for its job.
SKIP_KEY_PREFIX = "job:"


@dataclass(frozen=True)
class JobFields:
    """A call's job, concurrency policy and idempotency key (see docs/howto/job-policies.md)."""

    job: str = ""
    policy: str = ConcurrencyPolicy.ALLOW.value
    idempotency_key: str | None = None
    #: Whom the call is fair to in pools with strategy ``fair`` ("" when none).
    fairness_key: str = ""


def job_fields(name: str, args: Any, kwargs: Any, spec: PoolSpec, headers: Any) -> JobFields:
    """The job (what "same job" means for policies) and the keys of one call.

    The job is the periodic task's name for beat fires and manual starts, else the task
    name plus its job key; it is recorded when there is a key or a policy other than
    ``allow`` (and for every beat fire: a newer fire supersedes the job's queued retries,
    and a changed periodic task cancels its waiting fires). ``skip`` takes its job as
    idempotency key when the call has none of its own.
    """
    periodic = refusals.periodic_name(headers)
    key = resolve_key(spec.job_key, args, kwargs, what="job_key")
    policy = spec.concurrency_policy
    if periodic:
        job = periodic
    elif key is not None:
        job = f"{name}:{key}"
    elif policy != ConcurrencyPolicy.ALLOW:
        job = name
    else:
        job = ""
    if len(job) > 255:
        raise PoolConfigurationError(
            f"The job name {job[:60]!r}... is longer than 255 characters: use a shorter job_key."
        )
    idempotency = resolve_key(spec.idempotency_key, args, kwargs, what="idempotency_key")
    if idempotency is None and policy == ConcurrencyPolicy.SKIP:
        idempotency = f"{SKIP_KEY_PREFIX}{job}"[:255]
    fairness = resolve_key(spec.fairness_key, args, kwargs, what="fairness_key")
    return JobFields(
        job=job, policy=policy, idempotency_key=idempotency, fairness_key=fairness or ""
    )


class ExistingEntry(Exception):
    """Raised through ``send_task`` when the submit matched an unfinished entry."""

    def __init__(self, enqueued: Enqueued, fields: JobFields) -> None:
        super().__init__(enqueued.key)
        self.enqueued = enqueued
        self.fields = fields

    def reason(self) -> str:
        """``skipped: <job> is already waiting|running`` (or the idempotency key's)."""
        state = "waiting" if self.enqueued.existing_state == "waiting" else "running"
        if (
            self.fields.policy == ConcurrencyPolicy.SKIP
            and self.fields.idempotency_key == (f"{SKIP_KEY_PREFIX}{self.fields.job}"[:255])
        ):
            return f"skipped: {self.fields.job} is already {state}"
        return f"skipped: idempotency key {self.fields.idempotency_key} is already {state}"


logger = logging.getLogger("pools.celery.gate")


_original_send_task: Callable[..., Any] | None = None


def install() -> None:
    """Wrap ``Celery.send_task`` once per process (idempotent)."""
    global _original_send_task
    if _original_send_task is not None:
        return
    _original_send_task = celery_base.Celery.send_task
    celery_base.Celery.send_task = _gated_send_task  # type: ignore[method-assign,assignment]
    _install_revoke_hook()
    purge.install()


_original_revoke: Callable[..., Any] | None = None


def _install_revoke_hook() -> None:
    """``AsyncResult.revoke()`` / ``app.control.revoke()`` also cancel waiting entries."""
    global _original_revoke
    from celery.app import control

    _original_revoke = control.Control.revoke

    def revoke(self: Any, task_id: Any, *args: Any, **kwargs: Any) -> Any:
        for key in [task_id] if isinstance(task_id, str) else list(task_id or ()):
            admission.cancel_if_waiting(key, reason="revoked")
        assert _original_revoke is not None
        return _original_revoke(self, task_id, *args, **kwargs)

    control.Control.revoke = revoke  # type: ignore[method-assign]


#: Tasks gated on this worker only for the implicit default pool: whether a call of one
#: is pooled depends on the queue it is routed to (:func:`default_spec`), not on the task.
DEFAULT_GATED: set[str] = set()

#: Task name prefixes never put in the default pool (Celery's own and this app's tasks).
NEVER_DEFAULT = ("celery.", "pools.")


def default_spec(
    app: Celery, name: str, args: Any, kwargs: Any, options: dict[str, Any]
) -> PoolSpec | None:
    """The default pool's spec for a call of a task without ``@pooled``, if it applies.

    It applies when ``POOLS['DEFAULT_POOL']`` is on and Celery's router sends the call to
    one of its queues (routing as ``send_task`` will do it: ``queue`` option, task routes,
    the default queue).
    """
    default = definitions.default_pool()
    if default is None or name.startswith(NEVER_DEFAULT):
        return None
    return (
        PoolSpec.build(default.name, 1)
        if _routed_queue(app, name, args, kwargs, options) in default.queues
        else None
    )


def _routed_queue(app: Celery, name: str, args: Any, kwargs: Any, options: dict[str, Any]) -> str:
    routed = app.amqp.router.route(
        {k: v for k, v in options.items() if k in ("queue", "exchange", "routing_key")},
        name,
        args or (),
        kwargs or {},
        options.get("task_type"),
    )
    queue = routed.get("queue")
    return str(getattr(queue, "name", queue) or app.conf.task_default_queue)


def is_default_queue(queue: str) -> bool:
    """True if deliveries from ``queue`` must hold a claim of the default pool."""
    default = definitions.default_pool()
    return default is not None and queue in default.queues


def pool_default_tasks(app: Celery) -> list[str]:
    """Gate every local task without a spec for the default pool (worker side).

    The body then runs only under a claim when its delivery comes from a default-pool
    queue (:func:`pools.celery.worker.run_gated` asks :func:`is_default_queue`); from
    another queue it runs as before.
    """
    default = definitions.default_pool()
    if default is None:
        return []
    wrapped = []
    for name, task in list(app.tasks.items()):
        if name.startswith(NEVER_DEFAULT) or spec_of(task) is not None:
            continue
        gate_task(task, PoolSpec.build(default.name, 1))
        DEFAULT_GATED.add(name)
        wrapped.append(name)
    return wrapped


def pool_declared_tasks(app: Celery) -> list[str]:
    """Gate the local tasks named in ``POOLS['TASKS']`` that lack the decorator (worker side).

    Without this a worker would run such a task's body without a claim.
    """
    wrapped = []
    for name, declared in conf.get().TASKS.items():
        task = app.tasks.get(name)
        if task is None:
            # Most likely a misspelt name: the real task would run unpooled, silently.
            logger.warning(
                "POOLS['TASKS'] names %r, which this worker does not know (registered tasks "
                "with a similar name: %s); calls of it are not pooled. Check the spelling.",
                name,
                ", ".join(_similar(name, app.tasks.keys())) or "none",
            )
        elif spec_of(task) is None:
            gate_task(task, PoolSpec.from_dict(declared))
            wrapped.append(name)
    return wrapped


@signals.worker_init.connect(dispatch_uid="pools.celery.gate.declared_tasks")
def _gate_declared_tasks(sender: Any = None, **kwargs: Any) -> None:
    """Before the pool forks: gate tasks pooled only by name in ``POOLS['TASKS']``."""
    app = getattr(sender, "app", None)
    if app is not None:
        app.loader.import_default_modules()
        for name in pool_declared_tasks(app):
            logger.info("Task %s is pooled by POOLS['TASKS']", name)
        for name in pool_default_tasks(app):
            logger.debug("Task %s is pooled by POOLS['DEFAULT_POOL'] on its queues", name)


def _similar(name: str, names: Any) -> list[str]:
    import difflib

    return difflib.get_close_matches(name, [n for n in names if not n.startswith("celery.")], 3)


def spec_for(app: Celery, name: str, task_type: Any = None) -> PoolSpec | None:
    """The pool spec of task ``name``: from the task's decorator, else ``POOLS['TASKS']``."""
    if task_type is None:
        task_type = app._tasks.get(name)  # type: ignore[attr-defined]  # raw registry: no finalize
        unfinalized = not getattr(app, "finalized", True)  # not in celery-types' stubs
        if task_type is None and unfinalized and getattr(app, "autofinalize", True):
            # @shared_task tasks join an app's registry when it is finalized. A process whose
            # app is not finalized yet (a web process that only calls send_task by name)
            # would otherwise send a pooled task around the gate.
            app.finalize(auto=True)
            task_type = app._tasks.get(name)  # type: ignore[attr-defined]
    spec = spec_of(task_type) if task_type is not None else None
    if spec is not None and name in DEFAULT_GATED:
        spec = None  # gated here for the default pool only: decided by the call's queue
    if spec is None:
        declared = conf.get().TASKS.get(name)
        if declared is not None:
            spec = PoolSpec.from_dict(declared)
    return spec


def _gated_send_task(
    self: Celery, name: str, args: Any = None, kwargs: Any = None, **options: Any
) -> Any:
    assert _original_send_task is not None
    if options.pop(ADMITTED_OPTION, False):
        return _original_send_task(self, name, args, kwargs, **options)
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
        return _original_send_task(self, name, args, kwargs, **options)
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
    assert _original_send_task is not None
    options.pop(CLAIM_HEADER, None)
    options.pop(BUDGET_HEADER, None)
    headers = options.get("headers")
    if isinstance(headers, dict) and (CLAIM_HEADER in headers or BUDGET_HEADER in headers):
        dropped = (CLAIM_HEADER, BUDGET_HEADER)
        options["headers"] = {k: v for k, v in headers.items() if k not in dropped}

    def enqueue(message: messages.HeldMessage) -> None:
        _enqueue_held(message, spec, origin, fields or JobFields())

    connection = options.pop("connection", None)
    given = options.pop("producer", None) or options.pop("publisher", None)
    if given is None and connection is not None:
        given = app.amqp.Producer(connection, auto_declare=False)
    if given is not None:
        capture = messages.CapturingProducer(given, enqueue)
        return _original_send_task(app, name, args, kwargs, producer=capture, **options)
    with app.producer_or_acquire(None) as real:
        capture = messages.CapturingProducer(real, enqueue)
        return _original_send_task(app, name, args, kwargs, producer=capture, **options)


def _enqueue_held(
    message: messages.HeldMessage, spec: PoolSpec, origin: Origin | None, fields: JobFields
) -> None:
    refusals.check_size(message.task_name, message.body)
    headers = message.headers
    headers.pop(CLAIM_HEADER, None)
    headers.pop(BUDGET_HEADER, None)
    if origin is None:
        origin = Origin.BEAT if headers.get("periodic_task_name") else Origin.CODE
    try:
        fields = _inherited(fields, message.task_id, int(headers.get("retries") or 0))
        if fields.job:
            headers[messages.JOB_HEADER] = fields.job
        args, kwargs = _display(message)
        expires = message.header_time("expires")
        stored: dict[str, Any] = {messages.OPTION_KEY: message.to_json()}
        if expires is not None:
            stored["expires"] = expires.isoformat()
        spec = caps.with_run_cap(spec, str(headers.get("root_id") or ""), message.task_id)
        sub = _submission(message, spec, origin, args, kwargs, stored, expires, fields)
        _ensure_pools(spec)
        try:
            enqueued = admission.enqueue(sub)
        except UnknownPool as exc:
            if exc.pool not in spec.templates and exc.pool not in spec.caps:
                raise
            # The sweep retired this idle per-key or cap pool between our check and now.
            _ensure_pools(spec, again=True)
            enqueued = admission.enqueue(sub)
    except PoolUnavailable:
        locking.drop_broken_connection()
        raise
    if not enqueued.created:
        raise ExistingEntry(enqueued, fields)


def _inherited(fields: JobFields, task_id: str, attempt: int) -> JobFields:
    """A retry (sent by the task, without the call's ``pool_options`` and often without
    beat's headers) keeps the job, policy and key of the attempt that sent it."""
    if not attempt or fields.job or fields.idempotency_key is not None:
        return fields
    with unavailable_on_error(f"reading entry {task_id}"):
        row = (
            QueueEntry.objects.filter(key=task_id)
            .order_by("-queue_id")
            .values_list("job", "concurrency_policy", "idempotency_key")
            .first()
        )
    if row is None or not (row[0] or row[2]):
        return fields
    return JobFields(
        job=row[0], policy=row[1], idempotency_key=row[2], fairness_key=fields.fairness_key
    )


def _ensure_pools(spec: PoolSpec, *, again: bool = False) -> None:
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


class CeleryBridge:
    """Publishes admitted entries and reports entries that ended while waiting."""

    def publish(self, admissions: Sequence[Admission]) -> None:
        """Publish each held message with its claim header; requeue on broker failure.

        One producer (and its connection) for the whole pass; on a transport that batches
        publishes (kombu's ``Producer.batch``: Redis) the messages of one pass go out in one
        round trip. Where a batch fails as a whole, every entry of it is requeued: a message
        that did reach the broker then carries a stale token and is skipped at delivery.
        """
        from celery import current_app

        if not admissions:
            return
        now = timezone.now()
        with current_app.producer_or_acquire(None) as producer:
            batch = getattr(producer, "batch", None)
            if batch is None or len(admissions) == 1:
                for adm in admissions:
                    try:
                        self._publish_one(current_app, producer, adm, now)
                    except Exception as exc:
                        self._publish_failed(adm, exc)
                return
            sent: list[Admission] = []
            try:
                with batch():
                    for adm in admissions:
                        try:
                            self._publish_one(current_app, producer, adm, now)
                        except Exception as exc:  # this message only (e.g. its routing)
                            self._publish_failed(adm, exc)
                        else:
                            sent.append(adm)
            except Exception as exc:  # the batch's round trip failed
                for adm in sent:
                    self._publish_failed(adm, exc)

    def _publish_one(self, app: Celery, producer: Any, adm: Admission, now: datetime) -> None:
        claim = {CLAIM_HEADER: f"{adm.entry_id}:{adm.token}"}
        if adm.options.get(BUDGET_OPTION):
            claim[BUDGET_HEADER] = adm.options[BUDGET_OPTION]
        held = messages.held_in(adm.options)
        if held is not None:
            messages.publish(producer, held, extra_headers=claim, queues=app.amqp.queues, now=now)
            return
        # An entry stored before messages were held whole: rebuild it with send_task.
        assert _original_send_task is not None, "pools.celery.gate.install() was not called"
        options = dict(adm.options)
        headers = {**(options.pop("headers", None) or {}), **claim}
        _original_send_task(
            app, adm.task_name, adm.args, adm.kwargs, task_id=adm.key, headers=headers, **options
        )

    def _publish_failed(self, adm: Admission, exc: Exception) -> None:
        logger.exception("Publishing admitted entry %s failed; requeueing it", adm.entry_id)
        try:
            admission.requeue(
                adm.entry_id,
                adm.token,
                reason=f"publish failed: {exc}"[:255],
                admit=False,
                unstarted=True,
            )
        except Exception:
            logger.exception("Could not requeue entry %s; its lease will lapse", adm.entry_id)

    def report_finished(self, finished: Sequence[Finished]) -> None:
        """Store a failure (expired) or revocation (cancelled) result for each entry."""
        for item in finished:
            try:
                results.report(item)
            except Exception:
                logger.exception("Could not store the result of entry %s", item.entry_id)

    def terminate(self, key: str) -> None:
        """Revoke with terminate; the worker's ``task_revoked`` settles the claim."""
        from celery import current_app

        current_app.control.revoke(key, terminate=True)

    def wake_at(self, pools: Sequence[str], when: datetime) -> None:
        """Send ``pools.admit`` with a short countdown: timed admission without polling."""
        from celery import current_app

        assert _original_send_task is not None
        delay = max(0.0, (when - timezone.now()).total_seconds())
        try:
            _original_send_task(
                current_app,
                "pools.admit",
                (list(pools),),
                countdown=delay,
                expires=delay + 60,
                ignore_result=True,
            )
        except Exception as exc:
            # The entries are safely in line: the caller's call must not fail for this, and
            # the sweep (every SWEEP_SECONDS) runs the admission the wake-up would have.
            logger.warning(
                "Timed wake-up of pools %s not sent (%s); the next sweep admits them",
                ", ".join(pools),
                exc,
            )


#: The bridge named by the default ``POOLS["PUBLISHER"]``.
bridge = CeleryBridge()
