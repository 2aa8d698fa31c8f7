"""Value objects describing what a pooled task asks for, and their validation.

Pure Python: no database, no Celery. Used by the decorator (checked when it is
applied), by per-call overrides and by the enqueue service.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from pools.exceptions import PoolConfigurationError

#: A pool name: starts with a letter or digit; letters, digits, ``_ . : -``; at most 100.
POOL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:\-]{0,99}$")

#: Keys accepted in the per-call ``pool_options`` of ``apply_async``.
CALL_OPTIONS = frozenset(
    {
        "priority",
        "queue_timeout",
        "worker",
        "concurrency_policy",
        "job_key",
        "idempotency_key",
        "budget",
    }
)
#: Concurrency policies (``pools.models.ConcurrencyPolicy``; listed here, which imports no model).
POLICIES = ("allow", "forbid", "replace", "skip")
#: Longest job key or idempotency key (the columns hold 255 characters with the task name).
MAX_KEY_LENGTH = 200

#: A job key or idempotency key: a fixed string (per call) or a callable of the task's
#: arguments (``@pooled``) returning one (or None: no key for that call).
KeySource = Callable[..., object] | str | None

#: The kinds of run budget, in the order they are checked and shown.
BUDGET_KINDS = ("seconds", "cost", "tokens")


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


@dataclass(frozen=True, kw_only=True)
class Budget:
    """Limits on what one run (a workflow: every task sharing a ``root_id``) may spend.

    Each is optional (``None``: unlimited): ``seconds`` of task time measured by the
    workers, ``cost`` and ``tokens`` reported by the tasks with ``pools.charge()``.
    """

    seconds: float | None = None
    cost: float | None = None
    tokens: int | None = None

    @classmethod
    def from_mapping(cls, raw: object) -> Budget:
        """Check ``{"cost": 10, "tokens": 5000, "seconds": 600}`` (any subset, at least one)."""
        if isinstance(raw, Budget):
            return raw
        if not isinstance(raw, Mapping) or not raw:
            raise PoolConfigurationError(
                f"A run budget must be a dict with one or more of {list(BUDGET_KINDS)}, such as "
                f"{{'cost': 10, 'tokens': 5000, 'seconds': 600}}; got {raw!r}."
            )
        unknown = set(raw) - set(BUDGET_KINDS)
        if unknown:
            raise PoolConfigurationError(
                f"Unknown budget key(s) {sorted(unknown)}; allowed: {list(BUDGET_KINDS)}."
            )
        values: dict[str, Any] = {}
        for kind, value in raw.items():
            if value is None:
                continue
            if kind == "tokens":
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise PoolConfigurationError(
                        f"budget['tokens'] must be a positive integer or None, got {value!r}."
                    )
                values[kind] = value
            else:
                if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                    raise PoolConfigurationError(
                        f"budget[{kind!r}] must be a positive number or None, got {value!r}."
                    )
                values[kind] = float(value)
        if not values:
            raise PoolConfigurationError(
                f"A run budget needs at least one limit among {list(BUDGET_KINDS)}; got {raw!r}."
            )
        return cls(**values)

    def limits(self) -> dict[str, float | int]:
        """The limits that are set, by kind."""
        return {k: v for k in BUDGET_KINDS if (v := getattr(self, k)) is not None}


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


def _validate_timeout(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise PoolConfigurationError(
            f"queue_timeout must be a positive number of seconds or None, got {value!r}."
        )
    return float(value)


def validate_policy(value: object) -> str:
    """Return ``value`` if it is a concurrency policy, else raise ``PoolConfigurationError``."""
    if not isinstance(value, str) or value not in POLICIES:
        raise PoolConfigurationError(
            f"concurrency_policy must be one of {', '.join(POLICIES)}, got {value!r}."
        )
    return value


def validate_key(value: object, *, what: str) -> str:
    """Return ``value`` if it is a usable job or idempotency key (non-empty text, at most
    :data:`MAX_KEY_LENGTH` characters), else raise ``PoolConfigurationError``."""
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_KEY_LENGTH:
        raise PoolConfigurationError(
            f"{what} must be a non-empty string of at most {MAX_KEY_LENGTH} characters, "
            f"got {value!r}."
        )
    return value


def _validate_key_source(value: object, *, what: str) -> KeySource:
    if value is None or callable(value):
        return value
    return validate_key(value, what=what)


def resolve_key(source: KeySource, args: object, kwargs: object, *, what: str) -> str | None:
    """The key of one call: the string itself, or what the callable returns for the call's
    arguments (``None`` means no key). A bad result raises ``PoolConfigurationError``."""
    if source is None:
        return None
    if isinstance(source, str):
        return source
    call_args = list(args) if isinstance(args, list | tuple) else []
    call_kwargs = dict(kwargs) if isinstance(kwargs, Mapping) else {}
    try:
        value = source(*call_args, **call_kwargs)
    except Exception as exc:
        raise PoolConfigurationError(
            f"The {what} callable {getattr(source, '__qualname__', source)!r} failed for this "
            f"call: {type(exc).__name__}: {exc}. It receives the task's args and kwargs."
        ) from exc
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        value = str(value)
    return validate_key(value, what=f"The value of the {what} callable")


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
    #: What a new entry does while another entry of the same job waits or runs.
    concurrency_policy: str = "allow"
    #: Distinguishes jobs of one task ("same job" = task name + key; beat fires: the periodic
    #: task's name). A callable of the task's arguments (decorator) or a string (per call).
    job_key: KeySource = None
    #: A submit whose key matches an unfinished entry returns that entry: a callable of the
    #: task's arguments (decorator) or a string (per call).
    idempotency_key: KeySource = None
    #: Per call, on the first task of a run: the run's budget (:class:`Budget`).
    budget: Budget | None = None

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
        validate_policy(self.concurrency_policy)
        _validate_key_source(self.job_key, what="job_key")
        _validate_key_source(self.idempotency_key, what="idempotency_key")
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
        concurrency_policy: str = "allow",
        job_key: KeySource = None,
        idempotency_key: KeySource = None,
    ) -> PoolSpec:
        """Validate decorator-style arguments and return a spec."""
        return cls(
            demand=normalize_demand(pools, slots),
            priority=_validate_priority(priority),
            queue_timeout=_validate_timeout(queue_timeout),
            concurrency_policy=validate_policy(concurrency_policy),
            job_key=_validate_key_source(job_key, what="job_key"),
            idempotency_key=_validate_key_source(idempotency_key, what="idempotency_key"),
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PoolSpec:
        """Build from a settings mapping ``{"pools": ..., "slots": ..., "priority": ...}``."""
        unknown = set(data) - {"pools", "slots", "priority", "queue_timeout", "concurrency_policy"}
        if unknown or "pools" not in data:
            raise PoolConfigurationError(
                f"Invalid pooled task definition {dict(data)!r}: expected keys 'pools' (required), "
                f"'slots', 'priority', 'queue_timeout', 'concurrency_policy'."
            )
        return cls.build(
            data["pools"],
            data.get("slots", 1),
            priority=data.get("priority", 0),
            queue_timeout=data.get("queue_timeout"),
            concurrency_policy=data.get("concurrency_policy", "allow"),
        )

    def with_call_options(self, options: Mapping[str, Any] | None) -> PoolSpec:
        """Apply a call's ``pool_options`` to this spec (``priority``, ``queue_timeout``,
        ``concurrency_policy``, and ``job_key`` / ``idempotency_key`` as strings)."""
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
        if "concurrency_policy" in options:
            changes["concurrency_policy"] = validate_policy(options["concurrency_policy"])
        for name in ("job_key", "idempotency_key"):
            if name in options:  # per call: the key itself (None: no key for this call)
                value = options[name]
                changes[name] = None if value is None else validate_key(value, what=name)
        if "budget" in options:
            raw = options["budget"]
            changes["budget"] = None if raw is None else Budget.from_mapping(raw)
        return replace(self, **changes)

    @property
    def pools(self) -> list[str]:
        """Pool names in lock order."""
        return list(self.demand)
