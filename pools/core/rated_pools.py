"""Which pools have a rate, as the admitting side that does not read the rates itself needs.

The PostgreSQL engine's admit function checks the rates of the pools it admits from but
does not say which of them have one; the message of an entry admitted in a rated pool must
(:attr:`pools.core.records.Admission.rated`: its start confirms its place in the pool's
window of starts, :mod:`pools.core.starts`). Kept per process, read by name: a pool new to
the process is read at once; a rate added to a known pool in another process is seen within
:data:`TTL` (changed in this process, at once: :func:`forget`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from pools.core.locking import unavailable_on_error
from pools.models import Pool

#: Longest this process keeps what it read of the pools' rates (seconds).
TTL = 1.0

#: When the rates were read (``time.monotonic()``), and pool name -> has a rate, for the
#: pools asked about since.
_rated: tuple[float, dict[str, bool]] | None = None


def _read(names: list[str]) -> dict[str, str]:
    with unavailable_on_error("reading which pools have a rate"):
        return dict(Pool.objects.filter(name__in=names).values_list("name", "rate"))


def of(
    names: Iterable[str], *, read: Callable[[list[str]], dict[str, str]] = _read
) -> frozenset[str]:
    """Which of ``names`` have a rate, for an admitting side that does not read the pools'
    rates itself (the PostgreSQL engine's admissions). Kept per process: a name is read
    (one query for all such names, by ``read``: ``{name: rate}``) when new or when
    :data:`TTL` has passed since the last read; :func:`forget` drops what was read at once.
    """
    global _rated
    names = list(names)
    now = time.monotonic()
    if _rated is None or now - _rated[0] > TTL:
        _rated = (now, {})
    known = _rated[1]
    new = set(names) - known.keys()
    if new:
        rates = read(sorted(new))
        known.update({name: bool(rates.get(name)) for name in new})
    return frozenset(name for name in names if known[name])


def forget() -> None:
    """The pools' rates changed (in this process): :func:`of` reads them again."""
    global _rated
    _rated = None
