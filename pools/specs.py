"""Value objects describing what a pooled task asks for, and their validation.

Pure Python: no database, no Celery. Used by the decorator (checked when it is
applied), by per-call overrides and by the enqueue service.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pools.exceptions import PoolConfigurationError

#: A pool name: starts with a letter or digit; letters, digits, ``_ . : -``; at most 100.
POOL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:\-]{0,99}$")

#: Keys accepted in the per-call ``pool_options`` of ``apply_async``.
CALL_OPTIONS = frozenset({"priority", "queue_timeout", "worker", "fairness_key"})
#: Longest fairness key (the column's length).
FAIRNESS_KEY_MAX = 255
#: A fairness key: a string (or an int, kept as its decimal string), or a callable of the
#: task's arguments returning one.
FairnessKey = str | int | Callable[..., Any] | None


def validate_pool_name(name: object) -> str:
    """Return ``name`` if it is a valid pool name, else raise ``PoolConfigurationError``."""
    if not isinstance(name, str) or not POOL_NAME_RE.match(name):
        raise PoolConfigurationError(
            f"Invalid pool name {name!r}: use 1-100 characters, letters, digits and '_ . : -', "
            f"starting with a letter or digit (e.g. 'warehouse' or 'partner-api')."
        )
    return name


def validate_worker(value: object) -> str:
    """A Celery worker hostname such as ``w1@host`` (node affinity), at most 255 characters."""
    if not isinstance(value, str) or "@" not in value or len(value) > 255 or value != value.strip():
        raise PoolConfigurationError(
            f"pool_options['worker'] must be a Celery worker hostname such as 'w1@host' (the "
            f"name 'celery inspect ping' shows), got {value!r}."
        )
    return value


def validate_slots(value: object, *, what: str) -> int:
    """Return ``value`` if it is a positive integer, else raise with ``what`` in the message."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PoolConfigurationError(f"{what} must be a positive integer, got {value!r}.")
    return value


def normalize_demand(pools: str | Mapping[str, int], slots: int = 1) -> dict[str, int]:
    """Turn ``"warehouse"`` + ``slots`` or ``{"warehouse": 1, "api": 2}`` into a checked dict."""
    if isinstance(pools, str):
        return {validate_pool_name(pools): validate_slots(slots, what=f"slots for pool {pools!r}")}
    if isinstance(pools, Mapping):
        if not pools:
            raise PoolConfigurationError("A pooled task must name at least one pool.")
        if slots != 1:
            raise PoolConfigurationError(
                "Pass slots inside the dict for a multi-pool demand: "
                "@pooled({'warehouse': 2, 'partner-api': 1})."
            )
        return {
            validate_pool_name(name): validate_slots(n, what=f"slots for pool {name!r}")
            for name, n in sorted(pools.items())
        }
    raise PoolConfigurationError(
        f"@pooled expects a pool name or a {{pool: slots}} dict, got {type(pools).__name__}."
    )


def _validate_priority(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PoolConfigurationError(f"priority must be an integer, got {value!r}.")
    return value


def validate_fairness_key(value: object, *, what: str = "fairness_key") -> str:
    """A fairness key as stored: a string of at most 255 characters (an int as its digits)."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or len(value) > FAIRNESS_KEY_MAX or "\x00" in value:
        raise PoolConfigurationError(
            f"{what} must be a string of at most {FAIRNESS_KEY_MAX} characters (a tenant id, "
            f"say) or an int, got {value!r}."
        )
    return value


def _validate_fairness_spec(value: object) -> FairnessKey:
    if value is None or callable(value):
        return value
    return validate_fairness_key(value)


def _validate_timeout(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise PoolConfigurationError(
            f"queue_timeout must be a positive number of seconds or None, got {value!r}."
        )
    return float(value)


@dataclass(frozen=True, kw_only=True)
class PoolSpec:
    """What one pooled task asks of its pools."""

    #: Slots wanted per pool, sorted by pool name (the lock order).
    demand: dict[str, int]
    #: Pool priority: higher is admitted first. Distinct from Celery's broker ``priority``.
    priority: int = 0
    #: Seconds an entry may wait for admission before it expires; ``None`` waits forever.
    queue_timeout: float | None = None
    #: Node affinity (per call): the Celery hostname (``w1@host``) that alone may run it.
    worker: str = ""
    #: Whom a call is fair to in pools with strategy ``fair``: a string, or a callable of
    #: the task's arguments returning one (resolved per call, :meth:`for_call`).
    fairness_key: FairnessKey = None

    def __post_init__(self) -> None:
        """Check a spec however it was made (``build``, ``replace`` or by hand).

        Nothing reaches admission with a bad name, non-positive or non-integer slots, or a
        demand out of lock order.
        """
        if not isinstance(self.demand, Mapping) or not self.demand:
            raise PoolConfigurationError(
                f"A pool demand must be a non-empty {{pool: slots}} dict, got {self.demand!r}."
            )
        for name, slots in self.demand.items():
            validate_slots(slots, what=f"slots for pool {validate_pool_name(name)!r}")
        _validate_priority(self.priority)
        _validate_timeout(self.queue_timeout)
        object.__setattr__(self, "fairness_key", _validate_fairness_spec(self.fairness_key))
        if list(self.demand) != sorted(self.demand) or not isinstance(self.demand, dict):
            object.__setattr__(self, "demand", dict(sorted(self.demand.items())))

    @classmethod
    def build(
        cls,
        pools: str | Mapping[str, int],
        slots: int = 1,
        *,
        priority: int = 0,
        queue_timeout: float | None = None,
        fairness_key: FairnessKey = None,
    ) -> PoolSpec:
        """Validate decorator-style arguments and return a spec."""
        return cls(
            demand=normalize_demand(pools, slots),
            priority=_validate_priority(priority),
            queue_timeout=_validate_timeout(queue_timeout),
            fairness_key=_validate_fairness_spec(fairness_key),
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PoolSpec:
        """Build from a settings mapping ``{"pools": ..., "slots": ..., "priority": ...}``."""
        unknown = set(data) - {"pools", "slots", "priority", "queue_timeout", "fairness_key"}
        if unknown or "pools" not in data:
            raise PoolConfigurationError(
                f"Invalid pooled task definition {dict(data)!r}: expected keys 'pools' (required), "
                f"'slots', 'priority', 'queue_timeout', 'fairness_key'."
            )
        key = data.get("fairness_key")
        return cls.build(
            data["pools"],
            data.get("slots", 1),
            priority=data.get("priority", 0),
            queue_timeout=data.get("queue_timeout"),
            fairness_key=None if key is None else validate_fairness_key(key),
        )

    def with_call_options(self, options: Mapping[str, Any] | None) -> PoolSpec:
        """Apply a call's ``pool_options`` (``priority``, ``queue_timeout``) to this spec."""
        if not options:
            return self
        if not isinstance(options, Mapping):
            raise PoolConfigurationError(
                f"pool_options must be a dict such as {{'priority': 5}}, got {options!r}."
            )
        unknown = set(options) - CALL_OPTIONS
        if unknown:
            raise PoolConfigurationError(
                f"Unknown pool_options key(s) {sorted(unknown)}; allowed: {sorted(CALL_OPTIONS)}."
            )
        changes: dict[str, Any] = {}
        if "priority" in options:
            changes["priority"] = _validate_priority(options["priority"])
        if "queue_timeout" in options:
            changes["queue_timeout"] = _validate_timeout(options["queue_timeout"])
        if "worker" in options:
            changes["worker"] = validate_worker(options["worker"])
        if "fairness_key" in options:
            changes["fairness_key"] = validate_fairness_key(
                options["fairness_key"], what="pool_options['fairness_key']"
            )
        return replace(self, **changes)

    def for_call(self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None) -> PoolSpec:
        """This spec with its fairness key resolved for one call (a callable is called with
        the call's arguments). Raises ``PoolConfigurationError`` when it fails."""
        key = self.fairness_key
        if not callable(key):
            return self
        try:
            value = key(*(args or ()), **(kwargs or {}))
        except Exception as exc:
            raise PoolConfigurationError(
                f"The fairness_key callable {getattr(key, '__name__', key)!r} failed on the call's "
                f"arguments ({type(exc).__name__}: {exc}); it receives the task's own "
                f"arguments, e.g. fairness_key=lambda tenant_id, **kw: tenant_id."
            ) from exc
        return replace(
            self,
            fairness_key=validate_fairness_key(value, what="the fairness_key callable's result"),
        )

    @property
    def fairness(self) -> str:
        """The resolved fairness key of a call ("" when none, or not resolved yet)."""
        key = self.fairness_key
        return key if isinstance(key, str) else ""

    @property
    def pools(self) -> list[str]:
        """Pool names in lock order."""
        return list(self.demand)
