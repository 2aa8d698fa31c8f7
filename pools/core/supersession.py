"""Job supersession: a newer entry of a job ends the older waiting ones it replaces
(``replace``, a beat fire ending queued retries), and a job's retries end when it succeeds
or is cancelled. See docs/howto/job-policies.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django.utils import timezone

from pools.core.ending import finish_waiting
from pools.core.locking import unavailable_on_error
from pools.core.pass_runs import end_waiting
from pools.core.records import Finished, Submission
from pools.models import Pool, QueueEntry
from pools.states import ConcurrencyPolicy, EntryState, Origin

#: Entries of one job ended per call of :func:`end_waiting_of_job` (the next call takes the rest).
JOB_BATCH = 500


def supersedes(sub: Submission) -> bool:
    """The submit ends older waiting entries of its job (``replace``, a beat fire)."""
    if not sub.job:
        return False
    return sub.concurrency_policy == ConcurrencyPolicy.REPLACE or (
        sub.origin == Origin.BEAT and not sub.attempt
    )


def supersede_on_enqueue(
    sub: Submission, entry: QueueEntry, pools: dict[str, Pool], now: datetime
) -> tuple[list[Finished], dict[str, Any] | None]:
    """End the waiting entries of the new entry's job that it supersedes.

    ``replace``: every older waiting entry of the job. A scheduled fire (beat, first
    attempt): the job's queued retries. Those in the locked pools end in this transaction;
    returns them, and the arguments of :func:`end_waiting_of_job` for any others. See
    docs/howto/job-policies.md.
    """
    if not sub.job:
        return [], None
    if sub.concurrency_policy == ConcurrencyPolicy.REPLACE:
        reason, retries_only = f"replaced by a newer entry of job {sub.job} ({sub.key})", False
    elif sub.origin == Origin.BEAT and not sub.attempt:
        reason, retries_only = f"superseded by a newer fire of job {sub.job} ({sub.key})", True
    else:
        return [], None
    older = waiting_of_job(sub.job, retries_only=retries_only).exclude(pk=entry.pk)
    mine, others = [], False
    for row in older[:JOB_BATCH]:
        if set(row.demand) <= pools.keys():
            mine.append(row)
        else:
            others = True
    finished = finish_waiting(mine, EntryState.SUPERSEDED, now, reason=reason) if mine else []
    rest = {"state": EntryState.SUPERSEDED, "reason": reason, "retries_only": retries_only}
    return finished, ({**rest, "exclude": entry.pk} if others else None)


def waiting_of_job(job: str, *, retries_only: bool = False) -> Any:
    """Waiting entries of ``job`` (index ``pools_entry_job``), oldest first."""
    rows = QueueEntry.objects.filter(
        job=job, finished_at__isnull=True, state=EntryState.WAITING
    ).order_by("queue_id")
    return rows.filter(attempt__gt=0) if retries_only else rows


def end_waiting_of_job(
    job: str,
    *,
    state: EntryState,
    reason: str,
    retries_only: bool = False,
    origins: Sequence[str] = (),
    exclude: int | None = None,
    ids: Sequence[int] | None = None,
) -> int:
    """End the waiting entries of ``job`` (``superseded`` or ``cancelled``) with ``reason``.

    Used when a job's retries are superseded (a success, a cancellation) and when its
    periodic task changes (``origins``: only entries from beat fires and manual starts;
    ``ids``: only these entries).
    Each group of pools is locked in turn; their results become revocations after commit.
    Returns how many entries ended.
    """
    if not job:
        return 0
    rows = waiting_of_job(job, retries_only=retries_only)
    if origins:
        rows = rows.filter(origin__in=list(origins))
    if exclude is not None:
        rows = rows.exclude(pk=exclude)
    if ids is not None:
        rows = rows.filter(pk__in=list(ids))
    with unavailable_on_error(f"ending waiting entries of job {job}"):
        found = list(rows.values_list("queue_id", "demand")[:JOB_BATCH])
    return end_waiting(
        found,
        timezone.now(),
        lambda entries, now: finish_waiting(entries, state, now, reason=reason[:255]),
    )


def supersede_retries(job: str, *, reason: str) -> int:
    """A success or a cancellation of ``job``: its queued retries end ``superseded``."""
    return end_waiting_of_job(job, state=EntryState.SUPERSEDED, reason=reason, retries_only=True)
