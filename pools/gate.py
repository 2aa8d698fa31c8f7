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

import json
import logging
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import Celery
from celery.app import base as celery_base
from celery.utils import uuid
from django.core.serializers.json import DjangoJSONEncoder
from django.utils import timezone

from pools import conf
from pools.admission import Admission, Finished, Submission
from pools.decorators import spec_of
from pools.exceptions import PoolConfigurationError
from pools.models import Origin
from pools.specs import PoolSpec

logger = logging.getLogger("pools.gate")

#: Message header carrying ``"<entry id>:<token>"`` on admitted messages.
CLAIM_HEADER = "pools_claim"
#: Internal ``send_task`` option marking a publish made by the gate itself.
ADMITTED_OPTION = "_pools_admitted"
#: Internal ``send_task`` option naming the origin of a submission (e.g. ungated delivery).
ORIGIN_OPTION = "_pools_origin"
#: The documented ``apply_async`` option for per-call pool overrides.
CALL_OPTION = "pool_options"

# Options that describe the local publish call, not the message: never stored.
_LOCAL_OPTIONS = frozenset(
    {"producer", "connection", "publisher", "router", "result_cls", "task_type", "add_to_parent"}
)

_original_send_task: Callable[..., Any] | None = None


def install() -> None:
    """Wrap ``Celery.send_task`` once per process (idempotent)."""
    global _original_send_task
    if _original_send_task is not None:
        return
    _original_send_task = celery_base.Celery.send_task
    celery_base.Celery.send_task = _gated_send_task  # type: ignore[method-assign,assignment]
    _install_revoke_hook()


_original_revoke: Callable[..., Any] | None = None


def _install_revoke_hook() -> None:
    """``AsyncResult.revoke()`` / ``app.control.revoke()`` also cancel waiting entries."""
    global _original_revoke
    from celery.app import control

    _original_revoke = control.Control.revoke

    def revoke(self: Any, task_id: Any, *args: Any, **kwargs: Any) -> Any:
        from pools import admission

        for key in [task_id] if isinstance(task_id, str) else list(task_id or ()):
            admission.cancel_if_waiting(key, reason="revoked")
        assert _original_revoke is not None
        return _original_revoke(self, task_id, *args, **kwargs)

    control.Control.revoke = revoke  # type: ignore[method-assign]


def pool_declared_tasks(app: Celery) -> list[str]:
    """Gate the local tasks named in ``POOLS['TASKS']`` that lack the decorator (worker side).

    Without this a worker would run such a task's body without a claim.
    """
    from pools.decorators import gate_task

    wrapped = []
    for name, declared in conf.get().TASKS.items():
        task = app.tasks.get(name)
        if task is not None and spec_of(task) is None:
            gate_task(task, PoolSpec.from_dict(declared))
            wrapped.append(name)
    return wrapped


def spec_for(app: Celery, name: str, task_type: Any = None) -> PoolSpec | None:
    """The pool spec of task ``name``: from the task's decorator, else ``POOLS['TASKS']``."""
    if task_type is None:
        task_type = app._tasks.get(name)  # type: ignore[attr-defined]  # raw registry: no finalize
    spec = spec_of(task_type) if task_type is not None else None
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
        if call_options:
            raise PoolConfigurationError(
                f"pool_options given for task {name!r}, which is not pooled. Decorate it with "
                f"@pooled or list it in POOLS['TASKS']."
            )
        return _original_send_task(self, name, args, kwargs, **options)
    return _submit(self, name, args, kwargs, spec.with_call_options(call_options), options, origin)


def _submit(
    app: Celery,
    name: str,
    args: Any,
    kwargs: Any,
    spec: PoolSpec,
    options: dict[str, Any],
    origin: str | None = None,
) -> Any:
    from pools import admission

    task_id = options.pop("task_id", None) or uuid()
    result_cls = options.get("result_cls") or app.AsyncResult
    add_to_parent = options.get("add_to_parent", True)
    now = timezone.now()
    not_before = _not_before(options.pop("eta", None), options.pop("countdown", None), now)
    parent = app.current_worker_task
    if parent is not None:
        options.setdefault("root_id", parent.request.root_id or parent.request.id)
        options.setdefault("parent_id", parent.request.id)
    stored = _storable(name, options, now)
    headers = stored.get("headers") or {}
    headers.pop(CLAIM_HEADER, None)
    if origin is None:
        origin = Origin.BEAT if headers.get("periodic_task_name") else Origin.CODE
    admission.enqueue(
        Submission(
            key=task_id,
            task_name=name,
            spec=spec,
            args=_json(list(args or ()), name, "args"),
            kwargs=_json(dict(kwargs or {}), name, "kwargs"),
            options=stored,
            not_before=not_before,
            origin=origin,
            root_id=stored.get("root_id") or "",
            parent_id=stored.get("parent_id") or "",
            attempt=int(stored.get("retries") or 0),
        )
    )
    result = result_cls(task_id)
    if add_to_parent and parent is not None:
        parent.add_trail(result)
    return result


def _not_before(eta: Any, countdown: Any, now: datetime) -> datetime | None:
    if countdown:
        return now + timedelta(seconds=float(countdown))
    if isinstance(eta, str):
        eta = datetime.fromisoformat(eta)
    if isinstance(eta, datetime):
        return eta if timezone.is_aware(eta) else timezone.make_aware(eta, UTC)
    return None


def _storable(name: str, options: dict[str, Any], now: datetime) -> dict[str, Any]:
    stored = {k: v for k, v in options.items() if k not in _LOCAL_OPTIONS and v is not None}
    expires = stored.get("expires")
    if isinstance(expires, int | float):
        # Relative expiry counts from the call, not from the later publish.
        stored["expires"] = now + timedelta(seconds=expires)
    result: dict[str, Any] = _json(stored, name, "options")
    return result


def _json(value: Any, name: str, what: str) -> Any:
    try:
        return json.loads(json.dumps(value, cls=DjangoJSONEncoder))
    except (TypeError, ValueError) as exc:
        raise PoolConfigurationError(
            f"Cannot hold a call of pooled task {name!r}: its {what} are not JSON-serializable "
            f"({exc}). Pass plain data (ids, strings, numbers) to pooled tasks."
        ) from exc


class CeleryBridge:
    """Publishes admitted entries and reports entries that ended while waiting."""

    def publish(self, admissions: Sequence[Admission]) -> None:
        """Publish each held message with its claim header; requeue on broker failure."""
        from celery import current_app

        from pools import admission as admission_service

        assert _original_send_task is not None, "pools.gate.install() was not called"
        for adm in admissions:
            options = dict(adm.options)
            headers = dict(options.pop("headers", None) or {})
            headers[CLAIM_HEADER] = f"{adm.entry_id}:{adm.token}"
            try:
                _original_send_task(
                    current_app,
                    adm.task_name,
                    adm.args,
                    adm.kwargs,
                    task_id=adm.key,
                    headers=headers,
                    **options,
                )
            except Exception as exc:
                logger.exception("Publishing admitted entry %s failed; requeueing it", adm.entry_id)
                admission_service.requeue(
                    adm.entry_id, adm.token, reason=f"publish failed: {exc}"[:255], admit=False
                )

    def report_finished(self, finished: Sequence[Finished]) -> None:
        """Store a failure (expired) or revocation (cancelled) result for each entry."""
        from pools import results

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
        _original_send_task(
            current_app,
            "pools.admit",
            (list(pools),),
            countdown=delay,
            expires=delay + 60,
            ignore_result=True,
        )


#: The bridge named by the default ``POOLS["PUBLISHER"]``.
bridge = CeleryBridge()
