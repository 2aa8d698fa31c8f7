"""One exception tree. Every message names the pool (or entry) and says what to do."""

from __future__ import annotations

from datetime import datetime

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
