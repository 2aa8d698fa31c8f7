"""A call's job fields: its job, concurrency policy, idempotency and fairness keys.

See docs/howto/job-policies.md. The send side (:mod:`pools.celery.sending`) computes them
for each call; a retry inherits them from the attempt that sent it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pools.celery import refusals
from pools.core.locking import unavailable_on_error
from pools.core.records import Enqueued
from pools.exceptions import PoolConfigurationError
from pools.models import ConcurrencyPolicy, QueueEntry
from pools.specs import PoolSpec, resolve_key

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
    #: A debounced call's key (docs/howto/debounce.md); None when the call is not debounced.
    debounce_key: str | None = None


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
    if spec.debounce is not None:
        # The call's idempotency_key (pool_options) is its debounce key; else the decorator's.
        source, what = (
            (spec.idempotency_key, "idempotency_key")
            if spec.idempotency_key is not None
            else (spec.debounce_key, "debounce_key")
        )
        debounce_key = resolve_key(source, args, kwargs, what=what)
        if debounce_key is None:
            raise PoolConfigurationError(
                f"The {what} of this debounced call of {name!r} is None: a debounced call "
                f"needs a key (calls with the same key collapse into one run)."
            )
        fairness = resolve_key(spec.fairness_key, args, kwargs, what="fairness_key")
        return JobFields(
            job=job, policy=policy, fairness_key=fairness or "", debounce_key=debounce_key
        )
    idempotency = resolve_key(spec.idempotency_key, args, kwargs, what="idempotency_key")
    if idempotency is None and policy == ConcurrencyPolicy.SKIP:
        idempotency = f"{SKIP_KEY_PREFIX}{job}"[:255]
    fairness = resolve_key(spec.fairness_key, args, kwargs, what="fairness_key")
    return JobFields(
        job=job, policy=policy, idempotency_key=idempotency, fairness_key=fairness or ""
    )


def inherited(fields: JobFields, task_id: str, attempt: int) -> JobFields:
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
