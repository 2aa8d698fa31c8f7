"""Global rate limits on pools: at most N body starts (and N admissions) per window, exact
across every worker.

A pool may carry one or more rates (``Pool.rate``, stored as ``"10/s,100000/d"``; empty
means none) besides its slots. Celery's notation: ``N/s``, ``N/m``, ``N/h``, plus ``N/d``;
a number ``N`` (or the string ``"N"``) means ``N/s``, as for Celery's ``rate_limit``.

**What counts.** Body starts, and admissions. A rate ``N/W`` holds twice: no window of
``W`` holds more than ``N`` admissions of the pool (the rule and the ring below), and no
window of ``W`` holds more than ``N`` confirmed starts of the pool's rated entries
(:mod:`pools.core.starts`: the worker's start of an entry admitted in a rated pool
confirms its place in the pool's ring of starts, under the pool's lock, with a margin of
:data:`HANDOFF_MARGIN` for the hand-off to the body's first line; a start with no room
waits for its place, or goes back to the head of its line when that is far). The starts
are what a partner API sees. Every admission of the pool counts once per rate,
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
admissions, and at most ``N`` confirmed starts, measured on the database clock. The
bodies' own start times (worker clocks) follow their confirmed starts by the hand-off,
which :data:`HANDOFF_MARGIN` covers while it varies by less than that.

**Wake-ups.** A head held back by a rate gets a timed wake-up for the moment its window
opens (``result.wake`` of the pass, as for ``not_before`` and the spend cap), converted
from the database clock to the local one by the offset read at the same time. Windows
opening more than ``WAKE_HORIZON`` (5 minutes) ahead are left to the sweep.

**Changing a pool's rates** (settings sync, admin, REST) deletes its marks (both rings):
the new rates start from empty windows (up to ``N`` admissions and starts at once right
after the change).

**PostgreSQL fast path.** The admit function (``pools/pg/sql/schema.sql``) applies
the same rule to the single-pool heads it admits, with the same rings and the same
clock (read once per call, after the pool locks); heads it hands to the Python pass
(multi-pool entries, policies) are checked by :mod:`pools.core.windows`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from django.db import connection
from django.utils import timezone

# The values themselves are pure (pools.rates_text); named here too, as before, for the
# callers above the core and for migration 0017 (it names ``validate_field`` here).
from pools.rates_text import (
    MAX_COUNT,
    UNITS,
    UNLIMITED_SLOTS,
    Rate,
    as_list,
    normalize,
    parse_rates,
    render,
    validate_field,
)

__all__ = [
    "HANDOFF_MARGIN",
    "MAX_COUNT",
    "START_INDEX",
    "UNITS",
    "UNLIMITED_SLOTS",
    "Rate",
    "as_list",
    "db_now",
    "normalize",
    "parse_rates",
    "render",
    "start_opens",
    "validate_field",
]

#: ``RateMark.rate_index`` of rate ``i``'s ring of starts: ``START_INDEX + i`` (the ring of
#: admissions is ``i``; a pool has far fewer rates).
START_INDEX = 1000
#: Added to each window for starts: a body's first line runs a few milliseconds after its
#: start was confirmed (the commit, the return to the worker), and that hand-off varies
#: from one start to the next. Start ``k + N`` comes at least ``W + HANDOFF_MARGIN`` after
#: start ``k``, so the bodies' own start times keep ``N`` per ``W`` while the hand-off
#: varies by less than this.
HANDOFF_MARGIN = timedelta(milliseconds=100)


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


def start_opens(
    marks: Sequence[tuple[Rate, datetime | None]],
    now: datetime,
    margin: timedelta = HANDOFF_MARGIN,
) -> datetime | None:
    """When a start may happen by the given rings of starts; ``None``: now.

    ``marks`` pairs each rate ``N/W`` with the time in the slot the next start would
    write: the ``N``-th previous start (``None``: fewer than ``N`` starts so far). A start
    at ``now`` is allowed iff each such time is at most ``now - (W + margin)``, i.e. the
    window ``(now - W - margin, now]`` holds fewer than ``N`` starts; otherwise the latest
    time one of them opens.
    """
    latest: datetime | None = None
    for rate, at in marks:
        if at is None:
            continue
        opens = at + rate.window + margin
        if opens > now and (latest is None or opens > latest):
            latest = opens
    return latest
