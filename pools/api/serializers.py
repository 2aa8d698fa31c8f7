"""Bodies of the REST API: read-only views of the service objects, and the pool input."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rest_framework import serializers

from pools import pool_fields
from pools.core import rates
from pools.core.explain import BLOCKERS
from pools.exceptions import PoolConfigurationError
from pools.models import OverflowPolicy, PausedPolicy, Pool, Strategy


class ErrorSerializer(serializers.Serializer[Any]):
    """Every 4xx answer except validation errors: a message and a stable code."""

    detail = serializers.CharField(help_text="What went wrong and how to fix it.")
    code = serializers.CharField(help_text="Stable machine-readable code (PoolError.code, ...).")


class UnavailableSerializer(serializers.Serializer[Any]):
    """503: pool state is unavailable (database error or the lock bound passed)."""

    detail = serializers.CharField(help_text='Always "pool state is unavailable".')


class BadRequestSerializer(serializers.Serializer[Any]):
    """400 of a query or a small body: messages per field, or a message and a code."""

    detail = serializers.CharField(
        required=False, help_text="What is wrong (unreadable body, bad state or cursor)."
    )
    code = serializers.CharField(
        required=False, help_text="parse_error, invalid_cursor, ... (with detail)."
    )
    limit = serializers.ListField(child=serializers.CharField(), required=False)
    terminate = serializers.ListField(child=serializers.CharField(), required=False)
    non_field_errors = serializers.ListField(child=serializers.CharField(), required=False)


class ValidationErrorSerializer(serializers.Serializer[Any]):
    """400: messages per field (``non_field_errors`` for the whole body)."""

    name = serializers.ListField(child=serializers.CharField(), required=False)
    slots = serializers.ListField(child=serializers.CharField(), required=False)
    max_queued = serializers.ListField(child=serializers.CharField(), required=False)
    paused = serializers.ListField(child=serializers.CharField(), required=False)
    description = serializers.ListField(child=serializers.CharField(), required=False)
    non_field_errors = serializers.ListField(child=serializers.CharField(), required=False)


class HolderSerializer(serializers.Serializer[Any]):
    """An entry holding slots (admitted or running)."""

    queue_id = serializers.IntegerField()
    key = serializers.CharField(help_text="The Celery task id.")
    task = serializers.CharField(source="task_name")
    state = serializers.CharField()
    priority = serializers.IntegerField()
    slots = serializers.IntegerField(help_text="Slots it holds in this pool.")
    worker = serializers.CharField(
        help_text="Worker running it; empty until its start is recorded (on PostgreSQL: "
        "at the first lease renewal, or at the settle)."
    )
    admitted_at = serializers.DateTimeField(allow_null=True)
    started_at = serializers.DateTimeField(allow_null=True)
    lease_expires_at = serializers.DateTimeField(allow_null=True)
    attempt = serializers.IntegerField()
    root_id = serializers.CharField()


class WaitingSerializer(serializers.Serializer[Any]):
    """A waiting entry as seen from one pool: its place and why it waits."""

    queue_id = serializers.IntegerField()
    key = serializers.CharField()
    task = serializers.CharField(source="task_name")
    state = serializers.CharField()
    priority = serializers.IntegerField()
    slots = serializers.IntegerField(help_text="Slots it asks of this pool.")
    demand = serializers.DictField(
        child=serializers.IntegerField(), help_text="Every pool it asks for: {name: slots}."
    )
    enqueued_at = serializers.DateTimeField()
    not_before = serializers.DateTimeField(allow_null=True)
    deadline = serializers.DateTimeField(allow_null=True)
    position = serializers.IntegerField(
        allow_null=True, help_text="1-based place in the line; null when not in line."
    )
    blocked_by = serializers.ChoiceField(
        choices=BLOCKERS, allow_null=True, help_text="Why it waits; null when admissible now."
    )
    message = serializers.CharField(help_text="Why it waits, in one sentence.")
    eta = serializers.DateTimeField(allow_null=True, help_text="Estimated admission time.")
    attempt = serializers.IntegerField()


class RecentSerializer(serializers.Serializer[Any]):
    """A terminal entry of the pool (newest first)."""

    queue_id = serializers.IntegerField()
    key = serializers.CharField()
    task = serializers.CharField(source="task_name")
    state = serializers.CharField()
    reason = serializers.CharField(help_text="Why it ended (queue_timeout, revoked, ...).")
    slots = serializers.IntegerField()
    enqueued_at = serializers.DateTimeField()
    admitted_at = serializers.DateTimeField(allow_null=True)
    started_at = serializers.DateTimeField(allow_null=True)
    finished_at = serializers.DateTimeField(allow_null=True)
    worker = serializers.CharField()


class LineItemSerializer(WaitingSerializer):
    """An entry in a page of ``pools/<name>/entries/`` (any state)."""

    worker = serializers.CharField()
    admitted_at = serializers.DateTimeField(allow_null=True)
    started_at = serializers.DateTimeField(allow_null=True)
    finished_at = serializers.DateTimeField(allow_null=True)
    lease_expires_at = serializers.DateTimeField(allow_null=True)
    reason = serializers.CharField()


class PoolSnapshotSerializer(serializers.Serializer[Any]):
    """One pool: capacity, occupancy, the head of its line and recent terminal entries."""

    name = serializers.CharField()
    slots = serializers.IntegerField(help_text="Configured capacity.")
    capacity = serializers.IntegerField(
        help_text="Capacity in effect for admission: the old one while the pool drains."
    )
    draining = serializers.BooleanField(
        help_text="A capacity change waits for the entries queued before it to be admitted; "
        "new submits are refused (pool_draining) meanwhile."
    )
    held = serializers.IntegerField(help_text="Slots held by admitted and running entries.")
    free = serializers.IntegerField()
    max_queued = serializers.IntegerField(allow_null=True)
    paused = serializers.BooleanField()
    paused_policy = serializers.ChoiceField(
        choices=PausedPolicy.choices, help_text="What a submit does while the pool is paused."
    )
    overflow = serializers.ChoiceField(
        choices=OverflowPolicy.choices,
        help_text="What a submit does when the backlog is at max_queued.",
    )
    strategy = serializers.ChoiceField(
        choices=Strategy.choices,
        help_text="The order in which waiting entries are admitted: priority, fifo, lifo or "
        "fair (round robin across fairness keys).",
    )
    aging_seconds = serializers.IntegerField(
        allow_null=True,
        help_text="Strategy priority: one priority level gained per this many seconds waited "
        "(null: no aging).",
    )
    spend_cap = serializers.FloatField(
        allow_null=True,
        help_text="Daily spend cap in slot-seconds per UTC day (null: no cap).",
    )
    spent_today = serializers.FloatField(
        help_text="Slot-seconds spent on the current UTC day (0 without a cap)."
    )
    rate = serializers.ListField(
        child=serializers.CharField(),
        help_text='Rate limits on starts across every worker, e.g. ["10/s", "100000/d"] '
        "(empty: none). A pool with a rate and no slots has slots 2147483647 (unlimited).",
    )
    retiring = serializers.BooleanField(
        help_text="Removed from settings while it held or queued work: deleted once empty."
    )
    description = serializers.CharField()
    defined_in_settings = serializers.BooleanField()
    counts = serializers.DictField(
        child=serializers.IntegerField(),
        help_text="Unfinished entries per state: waiting, admitted, running (and delayed).",
    )
    running = HolderSerializer(many=True, source="holders")
    waiting = WaitingSerializer(many=True, source="head", help_text="The head of the line.")
    recent = RecentSerializer(many=True)
    mean_hold_seconds = serializers.SerializerMethodField(
        help_text="Mean hold time of recent entries (the ETA's basis); null without history."
    )
    template = serializers.CharField(
        help_text="The POOLS['TEMPLATES'] pattern of a per-key pool (empty for other pools)."
    )
    overrides = serializers.DictField(
        child=serializers.DictField(),
        help_text='A per-key pool\'s limits set at runtime: {"slots": {"value": 8, '
        '"template": 2}} (empty: none). Change them with pools/<name>/overrides.',
    )

    def get_mean_hold_seconds(self, obj: Any) -> float | None:
        """The snapshot's mean hold, in seconds."""
        return None if obj.mean_hold is None else round(obj.mean_hold.total_seconds(), 3)


class EntriesPageSerializer(serializers.Serializer[Any]):
    """A page of a pool's entries (cursor pagination, line order for ``waiting``)."""

    results = LineItemSerializer(many=True)
    next = serializers.CharField(allow_null=True, help_text="URL of the next page, or null.")
    next_cursor = serializers.CharField(allow_null=True)


class PlaceSerializer(serializers.Serializer[Any]):
    """Where an entry stands in one pool it asks for."""

    pool = serializers.CharField()
    slots = serializers.IntegerField()
    position = serializers.IntegerField(allow_null=True)
    blocked_by = serializers.ChoiceField(choices=BLOCKERS, allow_null=True)
    message = serializers.CharField()
    detail = serializers.DictField(help_text="holders, ahead, until, pool, free ...")
    eta = serializers.DateTimeField(allow_null=True)


class EntrySerializer(serializers.Serializer[Any]):
    """A queue entry."""

    queue_id = serializers.IntegerField()
    key = serializers.CharField()
    task = serializers.CharField(source="task_name")
    state = serializers.CharField()
    priority = serializers.IntegerField()
    demand = serializers.DictField(child=serializers.IntegerField())
    origin = serializers.CharField()
    enqueued_at = serializers.DateTimeField()
    not_before = serializers.DateTimeField(allow_null=True)
    deadline = serializers.DateTimeField(allow_null=True)
    admitted_at = serializers.DateTimeField(allow_null=True)
    started_at = serializers.DateTimeField(allow_null=True)
    finished_at = serializers.DateTimeField(allow_null=True)
    lease_expires_at = serializers.DateTimeField(allow_null=True)
    worker = serializers.CharField()
    attempt = serializers.IntegerField()
    root_id = serializers.CharField()
    parent_id = serializers.CharField()
    reason = serializers.CharField()
    fairness_key = serializers.CharField(
        help_text="Whom the entry is fair to in pools with strategy fair (empty: none)."
    )
    debounce_key = serializers.CharField(
        allow_null=True,
        help_text="A debounced entry's key (null: not debounced); docs/howto/debounce.md.",
    )


class ExplanationSerializer(EntrySerializer):
    """An entry and, per pool it asks for, its position, why it waits and an ETA."""

    blocked_by = serializers.ChoiceField(choices=BLOCKERS, allow_null=True)
    eta = serializers.DateTimeField(allow_null=True)
    pools = PlaceSerializer(many=True)


class CancelSerializer(serializers.Serializer[Any]):
    """Body of a cancel request (optional)."""

    terminate = serializers.BooleanField(
        default=False, help_text="Also stop an admitted or running entry (Celery revoke)."
    )


class JobStartSerializer(serializers.Serializer[Any]):
    """Body of ``POST jobs/<name>/start`` (optional)."""

    worker = serializers.CharField(
        required=False,
        allow_blank=True,
        max_length=255,
        help_text="Pin the call to this Celery worker (hostname such as 'w1@host'): it runs "
        "there only, and waits while that worker has no live heartbeat. Needs worker_direct.",
    )


class JobStartedSerializer(serializers.Serializer[Any]):
    """202: the job's task was sent; ``queue_id``/``pool``/``pools`` only when it is pooled."""

    queued = serializers.BooleanField(help_text="True when the task is pooled (in line).")
    key = serializers.CharField(help_text="The Celery task id.")
    queue_id = serializers.IntegerField(required=False)
    pool = serializers.CharField(required=False, help_text="First pool by name.")
    pools = serializers.ListField(child=serializers.CharField(), required=False)
    existing = serializers.BooleanField(
        required=False,
        help_text="True when nothing new was queued: an unfinished entry of the job (skip) or "
        "with the same idempotency key exists; key and queue_id are that entry's.",
    )


def _field_check(field: str, value: Any) -> Any:
    try:
        return pool_fields.check(field, value)
    except PoolConfigurationError as exc:
        raise serializers.ValidationError(str(exc)) from exc


def _table_check(field: str) -> Callable[[Any, Any], Any]:
    """The ``validate_<field>`` method of a pool field: the check of the pool field table."""

    def validate(self: Any, value: Any) -> Any:
        return _field_check(field, value)

    validate.__doc__ = f"{pool_fields.FIELDS[field].kind} (checked as settings are)."
    return validate


class PoolInputSerializer(serializers.Serializer[Any]):
    """Body of ``POST pools/`` and ``PATCH pools/<name>/`` (the rules of settings)."""

    name = serializers.CharField(max_length=100)
    slots = serializers.IntegerField(
        required=False,
        help_text="Capacity; required on create unless a rate is given (then unlimited).",
    )
    max_queued = serializers.IntegerField(allow_null=True, required=False)
    paused = serializers.BooleanField(required=False)
    description = serializers.CharField(allow_blank=True, required=False)
    overflow = serializers.ChoiceField(choices=OverflowPolicy.choices, required=False)
    paused_policy = serializers.ChoiceField(choices=PausedPolicy.choices, required=False)
    strategy = serializers.ChoiceField(choices=Strategy.choices, required=False)
    aging_seconds = serializers.IntegerField(
        allow_null=True,
        required=False,
        help_text="Strategy priority only: one priority level per this many seconds waited.",
    )
    spend_cap = serializers.FloatField(
        allow_null=True,
        required=False,
        help_text="Daily spend cap in slot-seconds per UTC day (null: no cap).",
    )
    rate = serializers.JSONField(
        allow_null=True,
        required=False,
        help_text='Rate limit on starts: "100/m" (N/s, N/m, N/h, N/d), a list such as '
        '["10/s", "100000/d"], or null / [] for none.',
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """On create, ``slots`` is required unless a rate is given (then unlimited)."""
        if self.instance is None and "slots" not in attrs:
            if not attrs.get("rate"):
                raise serializers.ValidationError(
                    {"slots": ["This field is required (or give a rate alone to limit starts)."]}
                )
            attrs["slots"] = rates.UNLIMITED_SLOTS
        return attrs

    def validate_name(self, value: str) -> str:
        """Valid name, not taken (on create), unchanged (on update)."""
        value = _field_check("name", value)
        if self.instance is not None:
            if value != self.instance.name:
                raise serializers.ValidationError(
                    "A pool cannot be renamed: entries name it. Create a new pool instead."
                )
        elif Pool.objects.filter(name=value).exists():
            raise serializers.ValidationError(f"A pool named {value!r} already exists.")
        return value

    # Every other field as the pool field table checks it (the rules of settings); the
    # rate comes back in its stored form ("10/s,100000/d").
    validate_slots = _table_check("slots")
    validate_max_queued = _table_check("max_queued")
    validate_paused = _table_check("paused")
    validate_description = _table_check("description")
    validate_overflow = _table_check("overflow")
    validate_paused_policy = _table_check("paused_policy")
    validate_strategy = _table_check("strategy")
    validate_aging_seconds = _table_check("aging_seconds")
    validate_spend_cap = _table_check("spend_cap")
    validate_rate = _table_check("rate")


class LimitSerializer(serializers.Serializer[Any]):
    """One limit of a per-key pool and where its value comes from."""

    value = serializers.JSONField(help_text="The value in effect (as stored; rate: '10/s').")
    source = serializers.ChoiceField(
        choices=["override", "values", "template"],
        help_text="override (set at runtime), values (the template's values callable) or template.",
    )
    template = serializers.JSONField(help_text="The template's own value.")
    without_override = serializers.JSONField(
        help_text="The value once the override is removed (the callable's, else the template's)."
    )


class OverridesSerializer(serializers.Serializer[Any]):
    """``pools/<name>/overrides``: a per-key pool's own limit values."""

    pool = serializers.CharField()
    template = serializers.CharField(help_text="The POOLS['TEMPLATES'] pattern.")
    exists = serializers.BooleanField(
        help_text="False while the pool is not created (or retired): the overrides apply "
        "when the next use creates it."
    )
    overrides = serializers.DictField(help_text="The values set at runtime, by field.")
    limits = serializers.DictField(child=LimitSerializer())
    values_error = serializers.CharField(
        help_text="Why the template's values callable was not used (empty when it was)."
    )


class OverridesInputSerializer(serializers.Serializer[Any]):
    """Body of ``PATCH pools/<name>/overrides``: the limits to override (at least one)."""

    slots = serializers.IntegerField(required=False, help_text="Capacity of this key's pool.")
    rate = serializers.JSONField(
        required=False,
        allow_null=True,
        help_text='Rate of this key\'s pool: "100/m", a list, or null / [] for none.',
    )
    max_queued = serializers.IntegerField(
        required=False, allow_null=True, help_text="Backlog limit (null: unlimited)."
    )

    validate_slots = _table_check("slots")
    validate_max_queued = _table_check("max_queued")
    validate_rate = _table_check("rate")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """At least one limit; no other field."""
        unknown = sorted(set(self.initial_data or {}) - set(self.fields))
        if unknown:
            raise serializers.ValidationError(
                {
                    "non_field_errors": [
                        f"Unknown field(s) {unknown}; a per-key pool's overrides are "
                        f"{list(pool_fields.LIMIT_FIELDS)}."
                    ]
                }
            )
        if not attrs:
            raise serializers.ValidationError(
                {"non_field_errors": ["Give at least one of slots, rate, max_queued."]}
            )
        return attrs
