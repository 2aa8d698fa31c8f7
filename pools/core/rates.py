"""Global rate limits on pools: at most N admissions per window, exact across every worker.

A pool may carry one or more rates (``Pool.rate``, stored as ``"10/s,100000/d"``; empty
means none) besides its slots. Celery's notation: ``N/s``, ``N/m``, ``N/h``, plus ``N/d``;
a number ``N`` (or the string ``"N"``) means ``N/s``, as for Celery's ``rate_limit``.

**What counts.** Admissions (starts). Every admission of the pool counts once per rate,
whatever happens to the attempt after it. A retry and a requeue after a lost lease are
admitted again, so they count again; an entry cancelled or expired while it waited was
never admitted and does not count.

**The rule.** An entry is admitted only if *every* rate of *every* pool it asks for has
room, atomically with the slot check, in the pool's own order (priority, fifo, lifo,
fair): a head held back by a rate blocks its line, like a head that does not fit (no
backfill). For a rate ``N/W`` the window is sliding and exact: an admission at time ``t``
is allowed iff fewer than ``N`` admissions of the pool happened in ``(t - W, t]``, so no
window of length ``W`` ever holds more than ``N`` admissions.

**Task rates.** ``@pooled(rate="20/s")`` puts the rate on the task's own pool
``task-cap:<task>`` (with ``max_running`` as its slots, if given; unlimited otherwise),
the global counterpart of Celery's per-worker ``rate_limit``. As for a task cap, a call
waiting for its task's rate is not yet in the lines of the named pools it also asks for
(ordered gates): it does not hold those lines up.

**How (the ring).** Per pool and per rate, a ring of ``N`` marks (:class:`~pools.models.
RateMark`, rows ``(pool, rate_index, slot, at)``) holds the times of the pool's last ``N``
admissions, keyed by the pool's admission counter ``Pool.admissions``: admission number
``k`` (0-based, counted before it) writes its time into slot ``k mod N``. So when the
next admission would be number ``k``, slot ``k mod N`` holds the time of the ``N``-th
previous admission; the admission is allowed iff that slot is empty or its time is
``<= now - W``. A pass that admits several entries gives them successive numbers
``k, k+1, ...``; once a pass has taken ``N`` of them, the next slot holds an admission of
this very pass (time ``now``), so the ``N+1``-th waits ``W``. Marks are written in the
admitting transaction, under the pool's row lock (:mod:`pools.core.locking`), so they
are as durable as the admissions: restarts and any number of workers change nothing.
Storage: at most ``N`` rows per rate (a ``100000/d`` rate keeps up to 100,000 rows).

**Whose clock.** The database's: :func:`db_now` reads ``clock_timestamp()`` on
PostgreSQL and ``UTC_TIMESTAMP(6)`` on MariaDB/MySQL, after the pool locks are taken, so
successive admissions of a pool get non-decreasing times whatever the workers' clocks
say. SQLite runs inside the process: its clock is the host's, read with microseconds.
Tolerance: the clock's resolution (microseconds); a window holds at most ``N``
admissions measured on the database clock. The bodies' own start times (worker clocks)
lag admission by the publish and the broker hop, which can bunch or spread them.

**Wake-ups.** A head held back by a rate gets a timed wake-up for the moment its window
opens (``result.wake`` of the pass, as for ``not_before`` and the spend cap), converted
from the database clock to the local one by the offset read at the same time. Windows
opening more than ``WAKE_HORIZON`` (5 minutes) ahead are left to the sweep.

**Changing a pool's rates** (settings sync, admin, REST) deletes its marks: the new
rates start from empty windows (up to ``N`` admissions at once right after the change).

**PostgreSQL fast path.** The admit function (``pools/pg/sql/schema.sql``) applies
the same rule to the single-pool heads it admits, with the same rings and the same
clock (read once per call, after the pool locks); heads it hands to the Python pass
(multi-pool entries, policies) are checked by :mod:`pools.core.windows`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.core.exceptions import ValidationError
from django.db import connection
from django.utils import timezone

from pools.exceptions import PoolConfigurationError

#: The capacity of a pool defined with a rate and no ``slots``: it limits starts only.
#: (``Pool.slots`` is a positive 32-bit integer; this is its largest value.)
UNLIMITED_SLOTS = 2_147_483_647
#: Largest ``N`` of one rate (the ring keeps ``N`` rows).
MAX_COUNT = 1_000_000
#: Window lengths by unit.
UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_RATE_RE = re.compile(r"^\s*(\d+)\s*(?:/\s*([smhd]))?\s*$")


@dataclass(frozen=True)
class Rate:
    """At most ``count`` admissions in any sliding window of ``seconds``."""

    #: Admissions allowed per window (at least 1).
    count: int
    #: The window's length in seconds (1, 60, 3600 or 86400).
    seconds: float

    def __str__(self) -> str:
        """``20/s``: Celery's notation (plus ``/d``)."""
        for unit, seconds in UNITS.items():
            if seconds == self.seconds:
                return f"{self.count}/{unit}"
        return f"{self.count}/{self.seconds:g}s"  # pragma: no cover - parse_rates never makes it

    @property
    def window(self) -> timedelta:
        """The window as a timedelta."""
        return timedelta(seconds=self.seconds)


def _error(what: str, message: str) -> PoolConfigurationError:
    exc = PoolConfigurationError(f"{what}: {message}" if what else message)
    exc.field = "rate"
    return exc


def _one(value: Any, what: str) -> Rate:
    if isinstance(value, bool):
        raise _error(what, f"{value!r} is not a rate; use N/s, N/m, N/h or N/d (e.g. '100/m').")
    if isinstance(value, int | float):
        if not math.isfinite(value) or value != int(value):
            raise _error(
                what,
                f"{value!r} is not a whole number of starts per second; write the rate with "
                f"a longer window instead (e.g. 0.5 per second is '30/m').",
            )
        value = f"{int(value)}/s"
    if not isinstance(value, str):
        raise _error(what, f"{value!r} is not a rate; use N/s, N/m, N/h or N/d (e.g. '100/m').")
    match = _RATE_RE.match(value)
    if match is None:
        raise _error(what, f"{value!r} is not a rate; use N/s, N/m, N/h or N/d (e.g. '100/m').")
    count = int(match.group(1))
    if count < 1 or count > MAX_COUNT:
        raise _error(
            what,
            f"{value!r} must allow between 1 and {MAX_COUNT:,} starts per window "
            f"(to pause a pool, pause it; for no limit, leave the rate out).",
        )
    return Rate(count=count, seconds=UNITS[match.group(2) or "s"])


def parse_rates(value: Any, *, what: str = "rate") -> tuple[Rate, ...]:
    """The rates of ``value``: a rate (``"100/m"``, or a number meaning N/s), a list of
    them, a comma-separated string (``"10/s,100000/d"``, as stored), or ``None`` / ``""``
    / ``[]`` for none. Raises :class:`~pools.exceptions.PoolConfigurationError` naming
    ``what`` with the fix.
    """
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        items: list[Any] = [part for part in value.split(",")]
        if any(not part.strip() for part in items):
            raise _error(what, f"{value!r} has an empty rate; separate rates with commas.")
    elif isinstance(value, list | tuple):
        items = list(value)
    else:
        items = [value]
    return tuple(_one(item, what) for item in items)


def render(rates: Iterable[Rate]) -> str:
    """The stored form of ``rates``: ``"10/s,100000/d"`` (empty for none)."""
    return ",".join(str(r) for r in rates)


def normalize(value: Any, *, what: str = "rate") -> str:
    """``value`` checked and in its stored form (see :func:`parse_rates`)."""
    return render(parse_rates(value, what=what))


def as_list(stored: str) -> list[str]:
    """The stored form as a list of rate strings (REST output, snapshots)."""
    return [str(r) for r in parse_rates(stored)] if stored else []


def validate_field(value: Any) -> None:
    """Model/form validator of ``Pool.rate`` (the admin form shows the message)."""
    try:
        parse_rates(value)
    except PoolConfigurationError as exc:
        raise ValidationError(str(exc)) from exc


def db_now() -> datetime:
    """The database's clock now (aware, UTC), read on the default connection.

    Call it inside the locked transaction (after the pool locks), so successive
    admissions of a pool read non-decreasing times.
    """
    vendor = connection.vendor
    if vendor == "postgresql":
        sql = "SELECT clock_timestamp()"
    elif vendor == "mysql":
        sql = "SELECT UTC_TIMESTAMP(6)"
    else:  # SQLite runs in this process: its clock is the host's
        return timezone.now()
    with connection.cursor() as cursor:
        cursor.execute(sql)
        value: datetime = cursor.fetchone()[0]
    if timezone.is_naive(value):
        value = value.replace(tzinfo=UTC)
    return value
