"""Running admission passes: in their own transaction, inside a caller's locked
transaction, and the follow-up passes after commit (multi-pool heads whose pools were not
all locked). The pass itself is :mod:`pools.core.admission_pass`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime

from django.db import transaction
from django.utils import timezone

from pools.core import dispatch, spendcap
from pools.core.admission_pass import PassResult, admit_locked
from pools.core.held import release_pending
from pools.core.locking import locked_pools, on_locked, on_released, pools_if_free
from pools.core.records import Admission, Finished
from pools.models import RELEASING, Demand, EntryState, Pool, QueueEntry

logger = logging.getLogger("pools.core.admission")

#: Bound on follow-up passes when a multi-pool head needs pools that were not locked.
MAX_PASSES = 4

#: What puts an admission whose message never reached the broker back in line (the
#: requeue of :mod:`pools.core.settling`, which registers it with :func:`on_unpublished`:
#: a requeue runs a pass, so this module cannot import it).
_unpublished: list[Callable[[Admission, str], None]] = []


def on_unpublished(requeue: Callable[[Admission, str], None]) -> None:
    """Register what :func:`requeue_unpublished` calls."""
    _unpublished[:] = [requeue]


def requeue_unpublished(admission: Admission, reason: str) -> None:
    """After-commit work failed before ``admission``'s message was handed to the broker: put
    it back in line at once (``dispatch.after_commit``'s ``requeue``), not at lease lapse."""
    if not _unpublished:  # pragma: no cover - pools.core.settling is always imported
        logger.error("Entry %s was not published; its lease will lapse", admission.entry_id)
        return
    _unpublished[0](admission, reason)


def run_pass(names: Iterable[str]) -> PassResult:
    """Run admission over ``names`` (follow-up passes for multi-pool heads included)."""
    total = PassResult()
    todo = set(names)
    for _ in range(MAX_PASSES):
        if not todo:
            break
        with locked_pools(todo) as pools:
            step = admit_locked(pools, timezone.now())
            dispatch.after_commit(
                step.admissions, step.finished, step.wake, requeue=requeue_unpublished
            )
        total.admissions.extend(step.admissions)
        total.finished.extend(step.finished)
        todo = still_needed(step, todo)
    return total


def still_needed(step: PassResult, locked: Iterable[str]) -> set[str]:
    """Pools to run a follow-up pass over: empty unless a multi-pool head lacked a lock."""
    locked = set(locked)
    return locked | step.needs if step.needs - locked else set()


def admit_in(pools: dict[str, Pool], now: datetime, finished: Sequence[Finished] = ()) -> set[str]:
    """Admission pass inside the caller's locked transaction; dispatch happens on commit.

    Returns the pools a follow-up pass must cover (see :func:`follow_up`).
    """
    step = admit_locked(pools, now)
    dispatch.after_commit(
        step.admissions, [*finished, *step.finished], step.wake, requeue=requeue_unpublished
    )
    return still_needed(step, pools)


def follow_up(needs: set[str]) -> list[Admission]:
    """After commit: admit multi-pool heads whose pools were not all locked.

    The caller's own change has committed: a failure here (pool state unavailable, a bug)
    is not the caller's, so it is logged and the pass is left to a wake-up instead.
    """
    if not needs:
        return []
    try:
        return run_pass(needs).admissions
    except Exception as exc:
        admit_later(needs, exc)
        return []


def admit_later(names: Iterable[str], exc: BaseException) -> None:
    """An admission pass that runs after the caller's change committed has failed: ask for
    another one at once (a timed wake-up; the sweep is the safety net), and do not fail the
    caller, whose own change stands."""
    pools = sorted(names)
    logger.warning(
        "Admission pass over pools %s after a committed change failed (%s); a wake-up runs it again",
        ", ".join(pools),
        exc,
    )
    if transaction.get_connection().in_atomic_block:  # a caller's transaction: after it
        transaction.on_commit(lambda: dispatch.wake(pools, timezone.now()))
    else:
        dispatch.wake(pools, timezone.now())


def admit(names: Iterable[str]) -> list[Admission]:
    """Run an admission pass over the named pools; returns what was admitted."""
    return run_pass(names).admissions


def admit_all() -> list[Admission]:
    """Run an admission pass over every pool (sweeps, capacity changes)."""
    names = list(Pool.objects.filter(paused=False).values_list("name", flat=True))
    return run_pass(names).admissions


def admit_after_settle(names: set[str], *, settled: int) -> set[str]:
    """One admission pass over ``names`` in its own transaction; returns the pools a
    follow-up pass must cover (what :func:`admit_in` returns).

    Pools with a spend cap are among ``names`` (the function leaves them to Python): the
    attempt just settled (entry ``settled``) adds its slot-seconds to them first, under
    the same locks, so the pass decides with the day's spend.
    """
    if not names:
        return set()
    with locked_pools(names) as pools:
        if any(p.spend_cap is not None for p in pools.values()):
            entry = QueueEntry.objects.only("demand", "admitted_at", "finished_at").get(pk=settled)
            spendcap.add_spend(pools, entry, entry.finished_at or timezone.now())
        return admit_in(pools, timezone.now())


def end_waiting(
    rows: Iterable[tuple[int, dict[str, int]]],
    now: datetime,
    finish: Callable[[list[QueueEntry], datetime], list[Finished]],
) -> int:
    """End the waiting entries of ``rows`` (id, demand) with ``finish``, pools' locks held.

    One transaction per set of pools; the freed places are admitted at once.
    """
    groups: dict[tuple[str, ...], list[int]] = {}
    for queue_id, demand in rows:
        groups.setdefault(tuple(sorted(demand)), []).append(queue_id)
    count = 0
    for names, ids in groups.items():
        with locked_pools(names) as pools:
            entries = list(QueueEntry.objects.filter(pk__in=ids, state=EntryState.WAITING))
            finished = finish(entries, now)
            needs = admit_in(pools, now, finished)
        follow_up(needs)
        count += len(entries)
    return count


# --------------------------------------------------------------------------- combining


def owed(names: Iterable[str]) -> set[str]:
    """Those of ``names`` with a release owed: a ``releasing`` demand row (an entry that
    settled while another transaction held the pool's lock). One index lookup."""
    names = list(names)
    if not names:
        return set()
    return set(
        Demand.objects.filter(pool__name__in=names, state=RELEASING)
        .values_list("pool__name", flat=True)
        .distinct()
    )


def release_owed(names: Iterable[str]) -> None:
    """After a transaction that held ``names``' locks has ended: while a release is owed
    in those pools, take their locks if free, release and run the admission pass.

    Why no wake-up is lost (``docs/concepts/contention.md``): a settler commits its
    ``releasing`` rows *before* it tries the pool's lock again (this function, after its commit); if that try
    finds the lock held, the holder's transaction ends after it, and this check runs after
    that: it reads the committed rows. A pool whose lock is held again here is that next
    holder's to re-check. Failures are logged and left to a wake-up (the settle stands).

    Each round releases what other settlers committed meanwhile, so the loop runs only as
    long as they keep settling in these pools while it holds their locks; it never waits.
    """
    todo = set(names)
    try:
        while todo:
            todo = owed(todo)
            if not todo:
                return
            with pools_if_free(todo, recheck=False) as (pools, _skipped):
                needs = admit_in(pools, timezone.now()) if pools else set()
            follow_up(needs)
            todo = set(pools)  # skipped pools are their holder's to re-check
    except Exception as exc:
        admit_later(todo, exc)


#: Every transaction holding pools' locks (``pools.core.locking``) ends with this re-check.
on_released(release_owed)
#: ...and every one starts by releasing the slots owed in the pools it locked.
on_locked(release_pending)
