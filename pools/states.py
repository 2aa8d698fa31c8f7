"""The states and kinds the models store: an entry's life, a demand row's, the event log's
kinds, a job's concurrency policy, where a submission came from.

Pure values (Django's choices enums are plain enums): every layer may import them, the
models included (:mod:`pools.models` names them as fields' choices).
"""

from __future__ import annotations

from django.db.models import TextChoices
from django.utils.translation import gettext_lazy as _


class EntryState(TextChoices):
    """Life of a queue entry (see docs/concepts/admission.md, States)."""

    WAITING = "waiting", _("waiting")
    ADMITTED = "admitted", _("admitted")
    RUNNING = "running", _("running")
    SUCCEEDED = "succeeded", _("succeeded")
    FAILED = "failed", _("failed")
    CANCELLED = "cancelled", _("cancelled")
    EXPIRED = "expired", _("expired")
    REJECTED = "rejected", _("rejected")
    SUPERSEDED = "superseded", _("superseded")
    RETRIED = "retried", _("retried")


#: State of a :class:`Demand` row (not of an entry) whose entry waits for its ``not_before``:
#: such an entry is not in line and blocks nothing until it is due.
DELAYED = "delayed"
#: Choices of ``Demand.state``: an entry's state, or ``delayed``.
DEMAND_STATES = [*EntryState.choices, (DELAYED, _("delayed (not yet due)"))]

#: States whose entries hold slots (the claim).
HELD_STATES = (EntryState.ADMITTED, EntryState.RUNNING)
#: States of an entry that has not finished (an idempotency key is taken while in one).
UNFINISHED_STATES = (EntryState.WAITING, EntryState.ADMITTED, EntryState.RUNNING)
#: States an entry never leaves.
TERMINAL_STATES = (
    EntryState.SUCCEEDED,
    EntryState.FAILED,
    EntryState.CANCELLED,
    EntryState.EXPIRED,
    EntryState.REJECTED,
    EntryState.SUPERSEDED,
    EntryState.RETRIED,
)


class ConcurrencyPolicy(TextChoices):
    """What a new entry does while another entry of its job waits or runs.

    See docs/howto/job-policies.md.
    """

    ALLOW = "allow", _("allow")
    FORBID = "forbid", _("forbid")
    REPLACE = "replace", _("replace")
    SKIP = "skip", _("skip")


class Origin(TextChoices):
    """Where a submission came from."""

    CODE = "code", _("code")
    BEAT = "beat", _("beat fire")
    MANUAL = "manual", _("manual start")
    API = "api", _("REST API")
    UNGATED = "ungated", _("message without a claim")


#: Demand states that count as "served or in line" for a fairness key's rounds (the
#: condition of the ``pools_demand_fair_key`` index): entries that ended without running
#: do not push their key's next round back.
FAIR_STATES = ("waiting", "admitted", "running", "succeeded", "failed", "retried")


class EventKind(TextChoices):
    """Kinds of lifecycle events in the append-only log."""

    ENQUEUED = "enqueued", _("enqueued")
    ADMITTED = "admitted", _("admitted")
    STARTED = "started", _("started")
    SETTLED = "settled", _("settled")
    REQUEUED = "requeued", _("requeued")
    EXPIRED = "expired", _("expired")
    CANCELLED = "cancelled", _("cancelled")
    REJECTED = "rejected", _("rejected")
    DROPPED = "dropped", _("dropped")
    SUPERSEDED = "superseded", _("superseded")
    SKIPPED = "skipped", _("skipped delivery")
    CAPACITY_CHANGED = "capacity", _("capacity changed")
    POOL_CREATED = "pool_created", _("pool created")
    POOL_DELETED = "pool_deleted", _("pool deleted")
    TERMINATE = "terminate", _("termination requested")
    BACKOFF = "backoff", _("backoff")
