"""Timed wake-ups beside W7 (``python -m pools.bench.core --wakers K``): a storm of them.

Every process that saw a head due at a time sends its own ``pools.admit`` for it, so in a
busy deployment wake-ups of one pool arrive in bursts while its settles go on. Here ``K``
processes each run the wake-up's admission on W7's pool every ``--wake-every``
milliseconds, all at the same instants (a burst of ``K`` each time), until W7's processes
are done: ``--wake-mode wake`` runs what a wake-up runs now
(:func:`pools.core.admission.wake`: on PostgreSQL an owed pass and a look that skips a
locked pool), ``--wake-mode pass`` what it ran before (:func:`pools.core.admission.admit`:
a Python pass that waits for the pool's lock). W7's figures beside each show what the
wake-ups cost the pool's settles; this prints the wake-ups' own count and time per call.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

#: What each waker calls: the wake-up's service now, or the Python pass it ran before.
MODES = ("wake", "pass")


def waker(
    pool: str,
    mode: str,
    every_ms: float,
    stop: Any,
    out: Any,
    publisher: str,
    admitted: list[Any],
) -> None:
    """One process (forked): the wake-up's admission over ``pool`` at each multiple of
    ``every_ms`` (wall clock, so the processes' calls fall together), at least once, until
    ``stop`` is set. ``publisher`` is W7's bridge, which hands each admission to
    ``admitted`` (its list, inherited through the fork)."""
    import django

    django.setup()
    from django.test.utils import override_settings

    from pools.core import admission, leases
    from pools.pg import fastpath

    fastpath.use_own_connection()  # as in a worker's pool process
    call = admission.wake if mode == "wake" else admission.admit
    times: list[float] = []
    period = every_ms / 1000
    with override_settings(POOLS={"PUBLISHER": publisher}):
        while True:  # at least one call, however soon W7 ends
            time.sleep(period - time.time() % period)
            t0 = time.perf_counter()
            call([pool])
            times.append(time.perf_counter() - t0)
            # A pass that took a release left while it held the lock admits W7's next
            # entry here: run it as W7's processes do (they settle only what they admitted).
            while admitted:
                adm = admitted.pop(0)
                if leases.start(adm.entry_id, adm.token, worker=f"waker-{os.getpid()}"):
                    admission.settle(adm.entry_id, adm.token, "succeeded", live_lease=True)
            if stop.is_set():
                break
    out.put({"pid": os.getpid(), "calls": times})


def figures(results: Sequence[dict[str, Any]], mode: str, every_ms: float) -> dict[str, Any]:
    """The wakers' figures: how many calls, and their time p50 / p99 (ms)."""
    calls = sorted(t for r in results for t in r["calls"])
    if not calls:
        return {"wakers": len(results), "wake_mode": mode, "wake_calls": 0}
    return {
        "wakers": len(results),
        "wake_mode": mode,
        "wake_every_ms": every_ms,
        "wake_calls": len(calls),
        "wake_call_ms_p50": round(1000 * calls[len(calls) // 2], 3),
        "wake_call_ms_p99": round(1000 * calls[int(len(calls) * 0.99)], 3),
    }
