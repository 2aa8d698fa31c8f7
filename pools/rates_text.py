"""Rate values: Celery's notation (``N/s``, ``N/m``, ``N/h``) plus ``N/d``, parsed and in
their stored form (``"10/s,100000/d"``).

Pure Python: no database. The rule rates enforce, and the database clock it reads, are in
:mod:`pools.core.rates`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.core.exceptions import ValidationError

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
