"""The one settings object: every key of the ``POOLS`` dict, its type and default.

Read lazily and reloaded on ``setting_changed`` so ``override_settings(POOLS=...)``
works in tests. Nothing else in the package reads ``django.conf.settings`` for
pool options.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from django.conf import settings as django_settings
from django.core.signals import setting_changed
from django.dispatch import receiver

from pools.exceptions import PoolConfigurationError


@dataclass(frozen=True, kw_only=True)
class PoolsSettings:
    """Typed view of ``settings.POOLS``; every key is optional."""

    #: Pool definitions synced to the database on ``migrate`` and ``manage.py pools sync``:
    #: ``{"warehouse": {"slots": 4, "max_queued": 100, "paused": False}}``.
    DEFINITIONS: dict[str, dict[str, Any]]
    #: Lease length in seconds given to every admission.
    LEASE_SECONDS: float = 30.0
    #: How often a running task renews its lease; ``None`` means a third of the lease.
    HEARTBEAT_SECONDS: float | None = None
    #: Bound, in seconds, on any pool operation's lock wait (PostgreSQL ``lock_timeout``).
    LOCK_TIMEOUT_SECONDS: float = 5.0
    #: The keeper interrupts a body whose renewal is not confirmed by this long before its
    #: lease ends, on the worker's own monotonic clock; ``None`` means one heartbeat.
    FENCE_MARGIN_SECONDS: float | None = None
    #: A lapsed lease is given back (its entry re-admitted elsewhere) only this long after
    #: its end: covers clock skew between the worker and the sweeping process.
    REQUEUE_GRACE_SECONDS: float = 1.0
    #: The largest difference you allow between the clocks of your machines (checked
    #: against the grace at start-up, ``pools.E005``; NTP keeps it to milliseconds).
    CLOCK_SKEW_SECONDS: float = 0.5
    #: Dotted path of the callable that publishes admitted entries (Celery glue by default).
    PUBLISHER: str = "pools.celery.bridge.bridge"
    #: Interval of the sweep periodic task (lapsed leases, deadlines, admission safety pass).
    SWEEP_SECONDS: float = 5.0
    #: How long finished entries and events are kept for the UI before the sweep prunes them.
    RETENTION_SECONDS: float = 86400.0
    #: A worker node with no heartbeat for this long is considered gone.
    NODE_TIMEOUT_SECONDS: float = 60.0
    #: Task names that are pooled even where the decorator is not imported
    #: (``send_task`` callers): ``{"app.tasks.export": {"pools": {"warehouse": 2}}}``.
    TASKS: dict[str, dict[str, Any]]
    #: On PostgreSQL, settle+admit and start run as one stored-function call each (one round
    #: trip, locks held for microseconds). ``False`` uses the portable ORM path everywhere.
    SQL_FAST_PATH: bool = True
    #: Largest message body (bytes, serialized and compressed as Celery would publish it) a
    #: pooled call may hold in the database; a larger call raises ``MessageTooLarge``.
    MAX_MESSAGE_BYTES: int = 1_048_576
    #: Per-key pools: a template per name pattern used in ``@pooled``, giving the capacity
    #: of each pool created on first use: ``{"tenant:{tenant_id}": {"slots": 1}}``.
    TEMPLATES: dict[str, dict[str, Any]]
    #: A pool made from a template with no unfinished entry for this long is deleted.
    TEMPLATE_IDLE_SECONDS: float = 3600.0
    #: Implicit default pool, off when ``None``: ``{"name": "default", "slots": 128,
    #: "queues": ["celery"]}`` admits every task without ``@pooled`` routed to one of
    #: ``queues`` through that pool (synced like a pool of ``DEFINITIONS``).
    DEFAULT_POOL: dict[str, Any] | None = None
    #: Server-side prepared statements on pools' own worker connection (PostgreSQL fast
    #: path). ``None`` follows ``DATABASES["default"]["OPTIONS"]["prepare_threshold"]``:
    #: off when that is ``None`` (Django's setting for a transaction pooler such as
    #: PgBouncer), on otherwise. Off, the connection also keeps no session state.
    PREPARED_STATEMENTS: bool | None = None
    #: Times a task body may back off (``raise pools.Backoff(seconds)``) before the next
    #: backoff fails it (``BackoffLimitExceeded``); ``@pooled(max_backoffs=N)`` per task.
    MAX_BACKOFFS: int = 10

    @property
    def heartbeat_seconds(self) -> float:
        """Renewal interval in effect."""
        return self.HEARTBEAT_SECONDS or self.LEASE_SECONDS / 3

    @property
    def fence_margin_seconds(self) -> float:
        """Fence margin in effect: the keeper interrupts at lease end minus this."""
        if self.FENCE_MARGIN_SECONDS is None:
            return self.heartbeat_seconds
        return self.FENCE_MARGIN_SECONDS

    def timing_violation(self) -> str | None:
        """Why the lease timing rule does not hold, or None when it holds.

        The rule (``docs/concepts/leases.md``)::

            HEARTBEAT < LEASE - FENCE_MARGIN < LEASE + REQUEUE_GRACE - CLOCK_SKEW

        The keeper must get a renewal in before it fences, and it must fence before the
        earliest moment another worker can be given the claim, seen from its own clock.
        """
        lease, beat = self.LEASE_SECONDS, self.heartbeat_seconds
        fence = lease - self.fence_margin_seconds
        readmit = lease + self.REQUEUE_GRACE_SECONDS - self.CLOCK_SKEW_SECONDS
        if not beat < fence:
            return (
                f"the keeper fences {fence:g}s after a confirmed renewal (LEASE_SECONDS - "
                f"FENCE_MARGIN_SECONDS), not after the next renewal at {beat:g}s "
                "(HEARTBEAT_SECONDS)"
            )
        if not fence < readmit:
            return (
                f"a claim may be re-admitted elsewhere {readmit:g}s after a renewal (LEASE_SECONDS "
                f"+ REQUEUE_GRACE_SECONDS - CLOCK_SKEW_SECONDS), not after the keeper fences "
                f"its body at {fence:g}s"
            )
        return None


_DICT_KEYS = {"DEFINITIONS", "TASKS", "TEMPLATES"}
_POSITIVE_NUMBERS = {
    "LEASE_SECONDS",
    "HEARTBEAT_SECONDS",
    "LOCK_TIMEOUT_SECONDS",
    "FENCE_MARGIN_SECONDS",
    "SWEEP_SECONDS",
    "RETENTION_SECONDS",
    "NODE_TIMEOUT_SECONDS",
    "TEMPLATE_IDLE_SECONDS",
}
#: Durations that may be zero.
_NON_NEGATIVE_NUMBERS = {"REQUEUE_GRACE_SECONDS", "CLOCK_SKEW_SECONDS"}
_BOOLEANS = {"SQL_FAST_PATH"}
_POSITIVE_INTEGERS = {"MAX_MESSAGE_BYTES"}
_KNOWN = {f.name for f in fields(PoolsSettings)}
_cached: PoolsSettings | None = None


def _load() -> PoolsSettings:
    raw = getattr(django_settings, "POOLS", None)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise PoolConfigurationError(
            "settings.POOLS must be a dict, e.g. POOLS = {'DEFINITIONS': {...}}."
        )
    unknown = sorted(set(raw) - _KNOWN)
    if unknown:
        raise PoolConfigurationError(
            f"Unknown key(s) in settings.POOLS: {', '.join(unknown)}. "
            f"Known keys: {', '.join(sorted(_KNOWN))}."
        )
    values: dict[str, Any] = {}
    for key in _DICT_KEYS:
        value = raw.get(key) or {}
        if not isinstance(value, dict):
            raise PoolConfigurationError(f"settings.POOLS[{key!r}] must be a dict, got {value!r}.")
        values[key] = dict(value)
    for key in _POSITIVE_NUMBERS:
        if key in raw and raw[key] is not None:
            value = raw[key]
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise PoolConfigurationError(
                    f"settings.POOLS[{key!r}] must be a positive number of seconds, got {value!r}."
                )
    for key in _NON_NEGATIVE_NUMBERS:
        if key in raw:
            value = raw[key]
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise PoolConfigurationError(
                    f"settings.POOLS[{key!r}] must be a number of seconds (0 or more), "
                    f"got {value!r}."
                )
    for key in _POSITIVE_INTEGERS:
        if key in raw:
            value = raw[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PoolConfigurationError(
                    f"settings.POOLS[{key!r}] must be a positive integer (bytes), got {value!r}."
                )
    if "MAX_BACKOFFS" in raw:
        value = raw["MAX_BACKOFFS"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise PoolConfigurationError(
                "settings.POOLS['MAX_BACKOFFS'] must be an integer (0 or more: the times a "
                f"task may back off before it fails), got {value!r}."
            )
    if raw.get("PREPARED_STATEMENTS") is not None and not isinstance(
        raw["PREPARED_STATEMENTS"], bool
    ):
        raise PoolConfigurationError(
            "settings.POOLS['PREPARED_STATEMENTS'] must be None (follow DATABASES OPTIONS"
            f"['prepare_threshold']), True or False, got {raw['PREPARED_STATEMENTS']!r}."
        )
    for key in _BOOLEANS:
        if key in raw and not isinstance(raw[key], bool):
            raise PoolConfigurationError(
                f"settings.POOLS[{key!r}] must be True or False, got {raw[key]!r}."
            )
    default_pool = raw.get("DEFAULT_POOL")
    if default_pool is not None and not isinstance(default_pool, dict):
        raise PoolConfigurationError(
            "settings.POOLS['DEFAULT_POOL'] must be None or a dict such as "
            f"{{'name': 'default', 'slots': 128, 'queues': ['celery']}}, got {default_pool!r}."
        )
    values.update({k: v for k, v in raw.items() if k not in _DICT_KEYS})
    return PoolsSettings(**values)


def get() -> PoolsSettings:
    """Return the current settings, loading them on first use."""
    global _cached
    if _cached is None:
        _cached = _load()
    return _cached


@receiver(setting_changed)
def _reload(*, setting: str, **kwargs: Any) -> None:
    global _cached
    if setting == "POOLS":
        _cached = None
