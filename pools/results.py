"""Celery results for entries that end without running, so nothing waits on them forever.

An expired entry becomes a FAILURE carrying :class:`~pools.exceptions.QueueTimeout`; a
cancelled one becomes REVOKED. Both call ``link_error`` callbacks and count as a failed
part of a chord, the way a failing task would.
"""

from __future__ import annotations

from celery import current_app
from celery.app.task import Context
from celery.exceptions import TaskRevokedError
from celery.utils.functional import maybe_list

from pools.admission import Finished
from pools.exceptions import QueueTimeout


def _request(item: Finished) -> Context:
    opts = item.options
    return Context(
        id=item.key,
        task=item.task_name,
        args=[],
        kwargs={},
        group=opts.get("group_id"),
        group_index=opts.get("group_index"),
        chord=opts.get("chord"),
        # Like send_task: apply_async(link_error=sig) holds one signature, not a list.
        callbacks=maybe_list(opts.get("link")),
        errbacks=maybe_list(opts.get("link_error")),
        root_id=opts.get("root_id"),
        parent_id=opts.get("parent_id"),
        delivery_info={},
        headers={},
        ignore_result=False,
    )


def report(item: Finished) -> None:
    """Store the outcome of one entry that ended while waiting."""
    backend = current_app.backend
    request = _request(item)
    if item.state == "expired":
        backend.mark_as_failure(item.key, QueueTimeout(item.pool, item.deadline), request=request)
        return
    reason = f"{item.state} while waiting for pool {item.pool!r}: {item.reason}"
    backend.mark_as_revoked(item.key, reason, request=request)
    if request.errbacks:
        backend._call_task_errbacks(request, TaskRevokedError(reason), None)  # type: ignore[attr-defined]
