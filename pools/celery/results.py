"""Celery results for entries that end without running, so nothing waits on them forever.

An entry whose Celery ``expires`` passed while it waited ends as Celery ends an expired
task: REVOKED with reason ``expired`` (a failed part of its chord). One whose
``queue_timeout`` passed becomes a FAILURE carrying :class:`~pools.exceptions.QueueTimeout`;
a cancelled one becomes REVOKED; one dropped by a full backlog's overflow policy
(``drop_oldest`` / ``drop_newest``) becomes a FAILURE carrying
:class:`~pools.exceptions.PoolFull`; one whose run spent a budget (reason ``budget``) a
FAILURE carrying :class:`~pools.exceptions.BudgetExceeded`. Those also call ``link_error`` callbacks and count
as a failed part of a chord, the way a failing task would.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from celery import current_app, states
from celery.app.task import Context
from celery.exceptions import TaskRevokedError
from celery.utils.functional import maybe_list

from pools.celery import messages
from pools.core.records import DEBOUNCED_OPTION, EXPIRES, Finished
from pools.exceptions import BudgetExceeded, PoolFull, QueueTimeout


def _request(item: Finished) -> Context:
    """The request context Celery's worker would have built from the held message."""
    held = messages.held_in(item.options)
    if held is None:  # an entry stored before messages were held whole
        opts: dict[str, Any] = dict(item.options)
        embed: dict[str, Any] = {
            "callbacks": opts.get("link"),
            "errbacks": opts.get("link_error"),
            "chord": opts.get("chord"),
        }
        headers: dict[str, Any] = {
            "group": opts.get("group_id"),
            "group_index": opts.get("group_index"),
            "root_id": opts.get("root_id"),
            "parent_id": opts.get("parent_id"),
        }
    else:
        _, _, embed = held.decode(accept=current_app.conf.accept_content)
        headers = held.headers
    return Context(
        id=item.key,
        task=item.task_name,
        args=[],
        kwargs={},
        group=headers.get("group"),
        group_index=headers.get("group_index"),
        chord=embed.get("chord"),
        # Like send_task: apply_async(link_error=sig) holds one signature, not a list.
        callbacks=maybe_list(embed.get("callbacks")),
        errbacks=maybe_list(embed.get("errbacks")),
        root_id=headers.get("root_id"),
        parent_id=headers.get("parent_id"),
        delivery_info={},
        headers={},
        ignore_result=False,
    )


def report(item: Finished) -> None:
    """Store the outcome of one entry that ended while waiting (and of the calls a
    debounced entry collapsed: each gets the same outcome)."""
    _report(item)
    for key in collapsed_ids(item.options):
        _report(replace(item, key=key))


def collapsed_ids(options: Any) -> list[str]:
    """The task ids of the earlier calls a debounced entry collapsed (its options or a
    request's ``pools_debounced`` header value)."""
    ids = options.get(DEBOUNCED_OPTION) if isinstance(options, dict) else options
    return [str(i) for i in ids] if isinstance(ids, list | tuple) else []


def mirror(task_id: str, collapsed: Any, state: str | None, retval: Any) -> None:
    """A debounced run ended: store its result under each call it collapsed.

    ``state`` and ``retval`` are the run's (``task_postrun``). Only final states are
    mirrored (not ``RETRY``: see docs/howto/debounce.md for retries). A failure is stored
    as the run's exception, so ``AsyncResult.get()`` raises it for every caller.
    """
    ids = collapsed_ids(collapsed)
    if not ids or state not in states.READY_STATES:
        return
    backend = current_app.backend
    for key in ids:
        if key != task_id:
            backend.store_result(key, retval, state)


def _report(item: Finished) -> None:
    backend = current_app.backend
    request = _request(item)
    if item.state == "expired" and item.reason == EXPIRES:
        backend.mark_as_revoked(item.key, "expired", request=request)
        return
    if item.state == "expired":
        backend.mark_as_failure(item.key, QueueTimeout(item.pool, item.deadline), request=request)
        return
    if item.budget is not None:
        # Its run spent a budget while it waited: fails as a submit to the run would.
        stop = item.budget
        exc = BudgetExceeded(stop.run, stop.budget, stop.limit, stop.spent)
        backend.mark_as_failure(item.key, exc, request=request)
        return
    if item.dropped_at is not None:
        # Dropped by a full backlog's overflow policy: fails as the submit would have.
        backend.mark_as_failure(item.key, PoolFull(item.pool, item.dropped_at), request=request)
        return
    reason = f"{item.state} while waiting for pool {item.pool!r}: {item.reason}"
    backend.mark_as_revoked(item.key, reason, request=request)
    if request.errbacks:
        backend._call_task_errbacks(request, TaskRevokedError(reason), None)  # type: ignore[attr-defined]
