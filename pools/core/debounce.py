"""Debounce: calls with the same key collapse into one waiting entry (docs/howto/debounce.md).

A debounced submit (``Submission.debounce_key``) looks for the *waiting* entry of its key.
Under the locks of both entries' pools (:mod:`pools.core.locking`) it either replaces that
entry's call with its own (task id, arguments, held message; the entry's earlier task ids
are kept in its ``options`` so each gets the run's result) and pushes its not-before time
to ``now + debounce``, or, when no entry of the key waits (none, or it was admitted
meanwhile), enqueues a new entry, as any submit does. An admitted or running entry is
never changed. Always the ORM engine's (``Submission.plain`` is false for a debounced
submit: :func:`pools.pg.engine.handed_to_orm`).
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime

from pools.core import dispatch
from pools.core.admission_pass import admit_locked, note_due
from pools.core.enqueueing import demand_rows, enqueue_locked, entry_fields
from pools.core.locking import locked_pools, unavailable, unavailable_on_error
from pools.core.pass_runs import requeue_unpublished
from pools.core.records import (
    DEBOUNCE_SECONDS_OPTION,
    DEBOUNCED_OPTION,
    Enqueued,
    Submission,
)
from pools.exceptions import PoolConfigurationError
from pools.models import Demand, EntryState, Pool, QueueEntry

#: Rounds of "look up the waiting entry, lock its pools" before giving up (each round only
#: repeats when the entry found moved to pools this call had not locked).
ROUNDS = 3


def waiting_entry(key: str) -> QueueEntry | None:
    """The waiting entry of debounce ``key`` (the newest, should there be several)."""
    return (
        QueueEntry.objects.filter(
            debounce_key=key, state=EntryState.WAITING, finished_at__isnull=True
        )
        .order_by("-queue_id")
        .first()
    )


def enqueue_debounced(
    sub: Submission, now: datetime, deadline: datetime | None, *, budgeted: bool = False
) -> Enqueued:
    """Collapse ``sub`` into the waiting entry of its key, or enqueue a new entry.

    ``sub.not_before`` is already the end of its quiet time (``now + debounce``, or a later
    ETA). Returns the entry (``created=True``: the call's task id is the entry's key now).
    """
    key = sub.debounce_key
    assert key is not None
    if budgeted:
        raise PoolConfigurationError(
            f"{sub.task_name}: a debounced call cannot be part of a run with a budget "
            f"(debounce replaces calls; a budget counts each one). Drop one of the two."
        )
    sub = replace(sub, options={**sub.options, DEBOUNCE_SECONDS_OPTION: sub.debounce})
    for _ in range(ROUNDS):
        with unavailable_on_error(f"debounce key {key!r}"):
            found = waiting_entry(key)
        names = set(sub.spec.demand) | set(found.demand if found is not None else {})
        with locked_pools(names) as pools:
            entry = waiting_entry(key)  # again, under the locks: only now it cannot move
            if entry is None:
                return enqueue_locked(sub, now, deadline)
            if not set(entry.demand) <= pools.keys():
                continue  # it changed pools meanwhile: lock those too
            _collapse(sub, entry, pools, now, deadline)
            step = admit_locked(pools, now)  # the old place may have held a line back
            dispatch.after_commit(
                step.admissions, step.finished, step.wake, requeue=requeue_unpublished
            )
            return Enqueued(entry_id=entry.queue_id, key=sub.key, admitted=False)
    moving = RuntimeError("its waiting entry kept moving to other pools; try the call again")
    raise unavailable(f"debounce key {key!r}", moving) from moving


def _collapse(
    sub: Submission,
    entry: QueueEntry,
    pools: dict[str, Pool],
    now: datetime,
    deadline: datetime | None,
) -> None:
    """Put ``sub``'s call in ``entry`` (locked, waiting) and push its start to ``sub.not_before``."""
    earlier = [*(entry.options or {}).get(DEBOUNCED_OPTION, []), entry.key]
    fields = entry_fields(sub, now, deadline)
    fields["options"] = {
        **fields["options"],
        DEBOUNCED_OPTION: [k for k in earlier if k != sub.key],
    }
    fields["enqueued_at"] = entry.enqueued_at  # it has waited since the first call
    for name, value in fields.items():
        setattr(entry, name, value)
    entry.save(update_fields=list(fields))
    Demand.objects.filter(entry_id=entry.queue_id).delete()
    assert sub.not_before is not None
    Demand.objects.bulk_create(demand_rows(sub, entry, pools, sub.not_before, delayed=True))
    note_due(pools, sub.spec.demand, sub.not_before)
