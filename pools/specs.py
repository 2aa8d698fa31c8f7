"""Value objects describing what a pooled task asks for, and their validation.

Pure Python: no database, no Celery. Used by the decorator (checked when it is
applied), by per-call overrides and by the enqueue service.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ParamSpec, TypeVar

from pools import rates_text
from pools.exceptions import PoolConfigurationError, PoolKeyError
from pools.pool_names import (
    TASK_CAP_PREFIX,
    cap_pool_name,
    format_pool_name,
    is_pattern,
    refuse_reserved,
    validate_pool_name_or_pattern,
)

#: Keys accepted in the per-call ``pool_options`` of ``apply_async``.
CALL_OPTIONS = frozenset(
    {
        "priority",
        "queue_timeout",
        "worker",
        "concurrency_policy",
        "job_key",
        "idempotency_key",
        "fairness_key",
        "debounce",
        "budget",
    }
)
#: Concurrency policies (the values of ``pools.states.ConcurrencyPolicy``).
POLICIES = ("allow", "forbid", "replace", "skip")
#: Longest job key or idempotency key (the columns hold 255 characters with the task name).
MAX_KEY_LENGTH = 200

#: A job key or idempotency key: a fixed string (per call) or a callable of the task's
#: arguments (``@pooled``) returning one (or None: no key for that call).
KeySource = Callable[..., object] | str | None

P = ParamSpec("P")
R = TypeVar("R")


def with_arguments_of(source: Callable[P, object]) -> Callable[[Callable[..., R]], Callable[P, R]]:
    """Give a function of ``(*args, **kwargs)`` the parameters of ``source``.

    Type checkers see ``source``'s parameters (names, types, defaults) on the decorated
    function; so do ``inspect.signature`` and ``help()``, with the decorated function's
    own return annotation. ``@pooled`` uses it to define its parameters once
    (:meth:`PoolSpec.build`).
    """

    signature = inspect.signature(source)

    def apply(func: Callable[..., R]) -> Callable[P, R]:
        @functools.wraps(func)
        def checked(*args: Any, **kwargs: Any) -> R:
            try:
                signature.bind(*args, **kwargs)
            except TypeError as exc:  # what Python says of a call that does not fit
                raise TypeError(f"{func.__name__}() {exc}") from None
            return func(*args, **kwargs)

        returns = inspect.signature(func).return_annotation
        checked.__signature__ = signature.replace(  # type: ignore[attr-defined]
            return_annotation=returns
        )
        return checked

    return apply


#: The kinds of run budget, in the order they are checked and shown.
BUDGET_KINDS = ("seconds", "cost", "tokens")


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


def positive_int(value: object, *, what: str) -> int:
    """Return ``value`` if it is a positive integer (not a bool), else raise
    ``PoolConfigurationError`` naming ``what``: slots, ``max_running``, ``max_queued``,
    ``aging_seconds``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PoolConfigurationError(f"{what} must be a positive integer, got {value!r}.")
    return value


def normalize_demand(pools: str | Mapping[str, int], slots: int = 1) -> dict[str, int]:
    """Turn ``"warehouse"`` + ``slots`` or ``{"warehouse": 1, "api": 2}`` into a checked dict."""
    if isinstance(pools, str):
        name = refuse_reserved(validate_pool_name_or_pattern(pools))
        return {name: positive_int(slots, what=f"slots for pool {pools!r}")}
    if isinstance(pools, Mapping):
        if not pools:
            raise PoolConfigurationError("A pooled task must name at least one pool.")
        if slots != 1:
            raise PoolConfigurationError(
                "Pass slots inside the dict for a multi-pool demand: "
                "@pooled({'warehouse': 2, 'partner-api': 1})."
            )
        return {
            refuse_reserved(validate_pool_name_or_pattern(name)): positive_int(
                n, what=f"slots for pool {name!r}"
            )
            for name, n in sorted(pools.items())
        }
    raise PoolConfigurationError(
        f"@pooled expects a pool name or a {{pool: slots}} dict, got {type(pools).__name__}."
    )


def _validate_priority(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PoolConfigurationError(f"priority must be an integer, got {value!r}.")
    return value


def validate_debounce(value: object) -> float | None:
    """Seconds of quiet a debounced call waits for (a positive number), or ``None``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise PoolConfigurationError(
            f"debounce must be a positive number of seconds (the quiet time before the one "
            f"run starts) or None, got {value!r}."
        )
    return float(value)


def _check_debounce(spec: PoolSpec) -> None:
    """A debounced spec has a key and no option that also uses the idempotency key."""
    if spec.debounce is None:
        return
    if spec.debounce_key is None and spec.idempotency_key is None:
        raise PoolConfigurationError(
            "debounce needs a key: calls with the same key collapse into one run. Give "
            "@pooled(debounce=..., debounce_key=lambda args, kwargs: ...) or "
            "pool_options={'debounce': seconds, 'idempotency_key': '<key>'}."
        )
    if spec.concurrency_policy != "allow":
        raise PoolConfigurationError(
            f"debounce cannot be combined with concurrency_policy="
            f"{spec.concurrency_policy!r}: a debounced call already collapses with the "
            f"waiting call of its key. Use one or the other."
        )


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


def validate_fairness_key(value: object, *, what: str = "fairness_key") -> str:
    """A fairness key as stored (strategy ``fair``): non-empty text of at most
    :data:`MAX_KEY_LENGTH` characters; an int is kept as its digits."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    return validate_key(value, what=what)


def _validate_fairness_source(value: object) -> KeySource:
    if value is None or callable(value):
        return value
    return validate_fairness_key(value)


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


#: Attribute carrying the spec on the wrapped ``run`` function (set by ``@pooled``).
SPEC_ATTR = "__pooled__"


def spec_of(task: Any) -> PoolSpec | None:
    """The spec of a task instance, class or function, or None if it is not pooled."""
    run = getattr(task, "run", task)
    spec = getattr(run, SPEC_ATTR, None)
    return spec if isinstance(spec, PoolSpec) else None


def _validate_max_backoffs(value: Any) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise PoolConfigurationError(
            f"@pooled(max_backoffs=...) must be an integer (0 or more), got {value!r}: "
            f"@pooled('partner-api', max_backoffs=5)."
        )
    return value


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
    #: Whom a call is fair to in pools with strategy ``fair`` (a tenant id, say): a callable
    #: of the task's arguments (decorator) or a string (per call); resolved by the gate.
    fairness_key: KeySource = None
    #: For a spec resolved from per-key patterns: ``{pool name: the pattern it came from}``.
    templates: dict[str, str] = field(default_factory=dict)
    #: Task cap: at most this many calls of the task admitted at once (pool
    #: ``task-cap:<task name>``, added by the gate, which knows the name). ``None``: no cap.
    max_running: int | None = None
    #: For a spec with its caps added: ``{cap pool name: its capacity}`` (made on first use).
    caps: dict[str, int] = field(default_factory=dict)
    #: Task rate (``@pooled(rate="20/s")``, stored form ``"20/s,1000/h"``): a global limit on
    #: the task's starts, kept by its task pool ``task-cap:<task name>`` (with
    #: ``max_running``, if given, as its slots; unlimited slots otherwise). Empty: none.
    rate: str = ""
    #: For a spec with its caps added: ``{cap pool name: its rate}`` (stored form).
    cap_rates: dict[str, str] = field(default_factory=dict)
    #: Per call, on the first task of a run: the run's budget (:class:`Budget`).
    budget: Budget | None = None
    #: Debounce: calls with the same key collapse into one run that starts once the key has
    #: been quiet this many seconds, with the last call's arguments (``None``: no debounce).
    debounce: float | None = None
    #: The debounce key: a callable of the task's arguments (decorator). Per call, the
    #: ``idempotency_key`` of ``pool_options`` is the key (it wins over this one).
    debounce_key: KeySource = None
    #: Backoffs (``raise pools.Backoff``) a call may make before the next one fails it;
    #: ``None``: ``POOLS["MAX_BACKOFFS"]``.
    max_backoffs: int | None = None

    def __post_init__(self) -> None:
        """Check a spec however it was made (``build``, ``replace`` or by hand).

        Nothing reaches admission with a bad name, non-positive or non-integer slots, or a
        demand out of lock order.
        """
        if self.max_running is not None:
            positive_int(self.max_running, what="max_running")
        _validate_max_backoffs(self.max_backoffs)
        object.__setattr__(self, "rate", rates_text.normalize(self.rate, what="rate"))
        if not isinstance(self.demand, Mapping) or not (
            self.demand or self.max_running or self.rate
        ):
            raise PoolConfigurationError(
                f"A pool demand must be a non-empty {{pool: slots}} dict, got {self.demand!r} "
                f"(or give max_running=N or rate='N/s' alone for a task pool)."
            )
        for name, slots in self.demand.items():
            checked = validate_pool_name_or_pattern(name)
            positive_int(slots, what=f"slots for pool {checked!r}")
        _validate_priority(self.priority)
        _validate_timeout(self.queue_timeout)
        validate_policy(self.concurrency_policy)
        _validate_key_source(self.job_key, what="job_key")
        _validate_key_source(self.idempotency_key, what="idempotency_key")
        _validate_key_source(self.debounce_key, what="debounce_key")
        object.__setattr__(self, "debounce", validate_debounce(self.debounce))
        _check_debounce(self)
        object.__setattr__(self, "fairness_key", _validate_fairness_source(self.fairness_key))
        if list(self.demand) != sorted(self.demand) or not isinstance(self.demand, dict):
            object.__setattr__(self, "demand", dict(sorted(self.demand.items())))

    @classmethod
    def build(
        cls,
        pools: str | Mapping[str, int] | None = None,
        slots: int = 1,
        *,
        priority: int = 0,
        queue_timeout: float | None = None,
        concurrency_policy: str = "allow",
        job_key: KeySource = None,
        idempotency_key: KeySource = None,
        max_running: int | None = None,
        fairness_key: KeySource | int = None,
        rate: str | float | list[str] | None = None,
        debounce: float | None = None,
        debounce_key: KeySource = None,
        max_backoffs: int | None = None,
    ) -> PoolSpec:
        """Validate decorator-style arguments and return a spec.

        This is the one definition of ``@pooled``'s parameters: ``pools.pooled`` and
        :func:`pools.celery.decorators.pooled` take them from here
        (:func:`with_arguments_of`), so a new option is one edit here (and its row in
        docs/reference/python-api.md).
        """
        if max_running is not None:
            max_running = positive_int(max_running, what="max_running")
        task_rate = rates_text.normalize(rate, what="@pooled(rate=...)")
        if debounce_key is not None and debounce is None:
            raise PoolConfigurationError(
                "@pooled(debounce_key=...) needs debounce=<seconds> (the quiet time)."
            )
        if debounce is not None and idempotency_key is not None:
            raise PoolConfigurationError(
                "@pooled(debounce=...) cannot take idempotency_key=...: a debounced call "
                "collapses with the waiting call of its key instead. Give debounce_key=..."
            )
        if debounce is not None and debounce_key is None:
            raise PoolConfigurationError(
                "@pooled(debounce=...) needs debounce_key=lambda args, kwargs: '<key>': "
                "calls with the same key collapse into one run."
            )
        if pools is None and max_running is None and not task_rate:
            raise PoolConfigurationError(
                "@pooled needs a pool name, a {pool: slots} dict, max_running=N (a task cap) "
                "or rate='N/s' (a task rate)."
            )
        return cls(
            demand={} if pools is None else normalize_demand(pools, slots),
            max_running=max_running,
            rate=task_rate,
            priority=_validate_priority(priority),
            queue_timeout=_validate_timeout(queue_timeout),
            concurrency_policy=validate_policy(concurrency_policy),
            job_key=_validate_key_source(job_key, what="job_key"),
            idempotency_key=_validate_key_source(idempotency_key, what="idempotency_key"),
            fairness_key=_validate_fairness_source(fairness_key),
            debounce=validate_debounce(debounce),
            debounce_key=_validate_key_source(debounce_key, what="debounce_key"),
            max_backoffs=_validate_max_backoffs(max_backoffs),
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PoolSpec:
        """Build from a settings mapping ``{"pools": ..., "slots": ..., "priority": ...}``."""
        allowed = {
            "pools",
            "slots",
            "priority",
            "queue_timeout",
            "concurrency_policy",
            "max_running",
            "fairness_key",
            "rate",
        }
        unknown = set(data) - allowed
        if unknown or not ("pools" in data or "max_running" in data or "rate" in data):
            raise PoolConfigurationError(
                f"Invalid pooled task definition {dict(data)!r}: expected keys 'pools' (required "
                f"unless 'max_running' or 'rate' is given), 'slots', 'priority', "
                f"'queue_timeout', 'concurrency_policy', 'max_running', 'fairness_key', 'rate'."
            )
        return cls.build(
            data.get("pools"),
            data.get("slots", 1),
            max_running=data.get("max_running"),
            priority=data.get("priority", 0),
            queue_timeout=data.get("queue_timeout"),
            concurrency_policy=data.get("concurrency_policy", "allow"),
            fairness_key=data.get("fairness_key"),
            rate=data.get("rate"),
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
        if "fairness_key" in options:
            value = options["fairness_key"]
            changes["fairness_key"] = (
                None
                if value is None
                else validate_fairness_key(value, what="pool_options['fairness_key']")
            )
        if "debounce" in options:
            changes["debounce"] = validate_debounce(options["debounce"])
        if "budget" in options:
            raw = options["budget"]
            changes["budget"] = None if raw is None else Budget.from_mapping(raw)
        return replace(self, **changes)

    @property
    def pools(self) -> list[str]:
        """Pool names in lock order."""
        return list(self.demand)

    def with_task_cap(self, task: str) -> PoolSpec:
        """This spec with its task pool in the demand (one slot per call): the task cap
        (``max_running``) and the task rate (``rate``) share the pool ``task-cap:<task>``;
        with a rate alone its slots are unlimited."""
        if self.max_running is None and not self.rate:
            return self
        name = cap_pool_name(TASK_CAP_PREFIX, task)
        slots = rates_text.UNLIMITED_SLOTS if self.max_running is None else self.max_running
        return replace(
            self,
            demand={**self.demand, name: 1},
            caps={**self.caps, name: slots},
            cap_rates={**self.cap_rates, name: self.rate} if self.rate else self.cap_rates,
        )

    def with_run_cap(self, pool: str) -> PoolSpec:
        """This spec with the run cap's pool ``pool`` (existing) in the demand."""
        return replace(self, demand={**self.demand, pool: 1})

    @property
    def patterns(self) -> list[str]:
        """The per-key patterns among the pools (``"tenant:{tenant_id}"``)."""
        return [name for name in self.demand if is_pattern(name)]

    def resolve(self, values: Mapping[str, Any], *, task: str = "") -> PoolSpec:
        """This spec with every per-key pattern formatted from a call's argument ``values``.

        Raises :class:`~pools.exceptions.PoolKeyError` when an argument is missing, a value
        makes an invalid name, or two pools of the demand end up with the same name.
        """
        if not self.patterns:
            return self
        demand: dict[str, int] = {}
        templates: dict[str, str] = {}
        for name, slots in self.demand.items():
            resolved = format_pool_name(name, values, task=task) if is_pattern(name) else name
            if resolved in demand:
                raise PoolKeyError(
                    f"Pools {sorted(self.demand)} of {task or 'the task'} name pool "
                    f"{resolved!r} twice for this call; give the per-key pool a distinct prefix."
                )
            demand[resolved] = slots
            if resolved != name:
                templates[resolved] = name
        return replace(self, demand=demand, templates=templates)
