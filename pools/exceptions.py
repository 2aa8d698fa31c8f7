"""One exception tree. Every message names the pool (or entry) and says what to do."""

from __future__ import annotations

from datetime import UTC, datetime

from django.core.exceptions import ImproperlyConfigured


class PoolError(Exception):
    """Root of every error raised by django-celery-pools."""

    #: Stable machine-readable code (also used by the REST layer).
    code = "pool_error"


class PoolConfigurationError(PoolError, ImproperlyConfigured):
    """A pool definition, a decorator argument or ``settings.POOLS`` is invalid."""

    code = "pool_configuration"
    #: The one field at fault, when there is one (the REST API answers 400 naming it).
    field: str | None = None


class UnknownPool(PoolError, LookupError):
    """A task or a call names a pool that does not exist."""

    code = "unknown_pool"

    def __init__(self, name: str) -> None:
        self.pool = name
        super().__init__(
            f"Pool {name!r} does not exist. Define it in settings.POOLS['DEFINITIONS'] and run "
            f"'manage.py pools sync' (or migrate), or create it in the admin."
        )


class EntryNotFound(PoolError, LookupError):
    """No queue entry has the given key."""

    code = "entry_not_found"

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"No queue entry with key {key!r}.")


class JobNotFound(PoolError, LookupError):
    """No periodic task (django-celery-beat ``PeriodicTask``) has the given name."""

    code = "job_not_found"

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(
            f"No periodic task named {name!r}. Create it in the admin (Periodic tasks) or check "
            f"the name: it is the PeriodicTask's name, not the task's dotted path."
        )


class PoolRefused(PoolError):
    """The pool refused an operation; the message says why."""

    code = "pool_refused"


class PoolFull(PoolRefused):
    """The pool's backlog (``max_queued``) is full."""

    code = "pool_full"

    def __init__(self, pool: str, max_queued: int) -> None:
        # ``args`` are plain data so the exception survives the JSON result serializer (an
        # entry dropped by an overflow policy fails with it in the result backend).
        super().__init__(pool, max_queued)
        self.pool = pool
        self.max_queued = max_queued

    def __str__(self) -> str:
        return (
            f"Pool {self.pool!r} is full: it already has {self.max_queued} waiting entries "
            f"(max_queued={self.max_queued}). Retry later, or raise max_queued for this pool."
        )


class BudgetExceeded(PoolRefused):
    """A run (every task sharing a ``root_id``) has spent one of its budgets.

    Raised by a submit of a task of that run, and stored as the failure of the run's entries
    that were still waiting when the budget was spent. ``args`` are plain data so the
    exception survives the JSON result serializer.
    """

    code = "budget_exceeded"

    def __init__(self, run: str, budget: str, limit: float, spent: float) -> None:
        super().__init__(run, budget, limit, spent)
        self.run = run
        self.budget = budget
        self.limit = limit
        self.spent = spent

    def __str__(self) -> str:
        unit = {"seconds": " task seconds", "tokens": " tokens"}.get(self.budget, "")
        return (
            f"Run {self.run!r} has spent its {self.budget} budget: {self.spent:g} of "
            f"{self.limit:g}{unit}. No further task of this run is admitted; start a new run, "
            f"or give this work a larger budget."
        )


class DemandExceedsCapacity(PoolRefused, PoolConfigurationError):
    """A task asks for more slots than the pool will ever have."""

    code = "demand_exceeds_capacity"

    def __init__(self, pool: str, demand: int, slots: int) -> None:
        self.pool = pool
        super().__init__(
            f"A task asks for {demand} slot(s) of pool {pool!r}, which has only {slots}: it could "
            f"never be admitted. Lower the task's slots or raise the pool's capacity."
        )


class PoolDraining(PoolRefused):
    """The pool is draining its queue at the old capacity after a capacity change."""

    code = "pool_draining"

    def __init__(self, pool: str, to_slots: int, left: int) -> None:
        self.pool = pool
        self.to_slots = to_slots
        self.left = left
        super().__init__(
            f"Pool {pool!r} is draining to {to_slots} slot(s) after a capacity change: "
            f"{left} entr{'y' if left == 1 else 'ies'} queued before the change "
            f"{'is' if left == 1 else 'are'} left, and new entries are refused until "
            f"{'it is' if left == 1 else 'they are'} admitted. Retry later; "
            f"'manage.py pools drain {pool}' shows the progress."
        )


class PoolPaused(PoolRefused):
    """The pool is paused and its ``paused_policy`` is ``reject``."""

    code = "pool_paused"

    def __init__(self, pool: str) -> None:
        self.pool = pool
        super().__init__(
            f"Pool {pool!r} is paused and refuses new entries (paused_policy='reject'). Retry "
            f"after it is resumed ('manage.py pools resume {pool}', the admin or the REST API), "
            f"or set paused_policy='queue' to let entries wait while it is paused."
        )


class NotCancellable(PoolRefused):
    """The entry is already running or finished and cannot be cancelled that way."""

    code = "not_cancellable"


class PoolInUse(PoolRefused):
    """A pool cannot be deleted while entries wait for it or hold its slots."""

    code = "pool_in_use"

    def __init__(self, pool: str, active: int) -> None:
        self.pool = pool
        self.active = active
        super().__init__(
            f"Pool {pool!r} still has {active} unfinished entr{'y' if active == 1 else 'ies'} "
            f"(waiting or holding slots). Cancel them or let them finish, then delete the pool."
        )


class PoolDefinedInSettings(PoolRefused):
    """A pool declared in ``POOLS['DEFINITIONS']`` cannot be deleted outside settings."""

    code = "pool_defined_in_settings"

    def __init__(self, pool: str) -> None:
        self.pool = pool
        super().__init__(
            f"Pool {pool!r} is defined in settings.POOLS['DEFINITIONS']: remove it there "
            f"(and deploy) instead; 'pools sync' would create it again."
        )


class PoolKeyError(PoolRefused, ValueError):
    """A per-key pool (``"tenant:{tenant_id}"``) cannot be named from the call's arguments."""

    code = "pool_key"


class UnserializableArguments(PoolRefused):
    """The call's arguments cannot be serialized for the broker, so nothing can be held.

    Raised by the gate as a subclass that is also kombu's ``EncodeError`` (what plain Celery
    raises), so existing ``except EncodeError`` handlers keep working.
    """

    code = "unserializable_arguments"

    def __init__(self, task: str, reason: str) -> None:
        self.task = task
        super().__init__(
            f"The arguments of {task} cannot be serialized ({reason}). Pass plain data (numbers, "
            f"strings, lists, dicts) such as ids rather than objects, or configure a serializer "
            f"that accepts them (task_serializer / accept_content)."
        )


class MessageTooLarge(PoolRefused):
    """The call's message is larger than ``POOLS['MAX_MESSAGE_BYTES']`` allows to hold."""

    code = "message_too_large"

    def __init__(self, task: str, size: int, limit: int) -> None:
        self.task = task
        self.size = size
        self.limit = limit
        super().__init__(
            f"The message of {task} is {size} bytes, above POOLS['MAX_MESSAGE_BYTES'] ({limit}): "
            f"pooled calls are held in the database until admitted. Pass a reference (an id, a "
            f"file path, an object-store key) instead of the data, or raise MAX_MESSAGE_BYTES."
        )


class PoolUnavailable(PoolError):
    """Pool state could not be read or written (database error or lock timeout)."""

    code = "pool_unavailable"


class LeaseLost(PoolError):
    """Raised into a task body whose claim (lease) is no longer held."""

    code = "lease_lost"


class QueueTimeout(PoolError):
    """An entry waited past its ``queue_timeout`` deadline without being admitted.

    Stored as the task's failure in the result backend; ``args`` are plain data so the
    exception survives the JSON result serializer.
    """

    code = "queue_timeout"

    def __init__(self, pool: str, deadline: datetime | str | None = None) -> None:
        super().__init__(pool, deadline.isoformat() if isinstance(deadline, datetime) else deadline)
        self.pool = pool
        self.deadline = self.args[1]

    def __str__(self) -> str:
        return (
            f"Gave up waiting for pool {self.pool!r}: the queue_timeout deadline "
            f"{self.deadline} passed before the task was admitted."
        )


class Backoff(PoolError):
    """Raised by a pooled task body to back off (a partner answered 429): not a failure.

    The attempt ends and gives its slots back; the entry returns to its place at the head
    of its line, and the pools pause for ``seconds`` (a timed pause: they admit nothing
    until it ends, by itself or from the admin or the REST API). ``pools`` names the pools
    to pause; by default every pool the entry asks for. A task may back off at most
    ``POOLS["MAX_BACKOFFS"]`` times (``@pooled(max_backoffs=N)``); past that it fails with
    :class:`BackoffLimitExceeded`. See docs/howto/backoff.md.
    """

    code = "backoff"

    def __init__(self, seconds: float, *, pools: list[str] | tuple[str, ...] | None = None) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
            raise PoolConfigurationError(
                f"Backoff(seconds) needs a positive number of seconds, got {seconds!r}: "
                f"raise pools.Backoff(30), or Backoff.from_retry_after(value, default=30)."
            )
        if pools is not None and (
            isinstance(pools, str) or not all(isinstance(p, str) for p in pools)
        ):
            raise PoolConfigurationError(
                f"Backoff(pools=...) takes a list of pool names, got {pools!r}: "
                f"Backoff(30, pools=['partner-api'])."
            )
        super().__init__(float(seconds))
        self.seconds = float(seconds)
        self.pools: tuple[str, ...] | None = None if pools is None else tuple(pools)

    @classmethod
    def from_retry_after(
        cls,
        value: str | int | float | None,
        *,
        default: float,
        pools: list[str] | tuple[str, ...] | None = None,
        now: datetime | None = None,
    ) -> Backoff:
        """A backoff for an HTTP ``Retry-After`` value: delta-seconds (``"120"``) or an
        HTTP-date (``"Wed, 21 Oct 2026 07:28:00 GMT"``). ``default`` seconds when the value
        is missing, unreadable or already past (a date in the past backs off ``default``
        too: the partner asked for a pause)."""
        return cls(retry_after_seconds(value, default=default, now=now), pools=pools)

    def __str__(self) -> str:
        where = f" pools {list(self.pools)!r}" if self.pools else ""
        return f"Back off{where} for {self.seconds:g} s (not a failure: the task runs again)."


def retry_after_seconds(
    value: str | int | float | None, *, default: float, now: datetime | None = None
) -> float:
    """Seconds to wait for an HTTP ``Retry-After`` value (RFC 9110 10.2.3), else ``default``."""
    from email.utils import parsedate_to_datetime

    if isinstance(value, bool) or value is None:
        return default
    if isinstance(value, int | float):
        return float(value) if value > 0 else default
    text = value.strip()
    if text.isdigit():
        return float(int(text)) if int(text) > 0 else default
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return default
    if when is None:
        return default
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    seconds = (when - (now or datetime.now(UTC))).total_seconds()
    return seconds if seconds > 0 else default


class BackoffLimitExceeded(PoolError):
    """A task body backed off more often than allowed (``MAX_BACKOFFS``): the task fails.

    Like Celery's ``MaxRetriesExceededError``: stored as the task's failure in the result
    backend; ``args`` are plain data so the exception survives the JSON result serializer.
    """

    code = "backoff_limit_exceeded"

    def __init__(self, task: str, limit: int) -> None:
        super().__init__(task, limit)
        self.task = task
        self.limit = limit

    def __str__(self) -> str:
        return (
            f"{self.task} backed off {self.limit} times already and asked again: it fails now. "
            f"Raise POOLS['MAX_BACKOFFS'] or @pooled(max_backoffs=N) if the partner needs more "
            f"patience, or lower the pool's slots or rate so it answers 429 less often."
        )
