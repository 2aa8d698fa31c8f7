"""``app.control.purge()`` also discards pooled calls still waiting for their slots.

Celery's purge empties the broker queues the app consumes from: every message not yet
delivered is gone. A pooled call that waits for its slots is not in the broker yet but in
its entry row (the held message), so without this it would survive the purge and run once
admitted. Each waiting entry whose held message is routed to one of those queues is
cancelled (its result becomes REVOKED with the reason ``purged``, rather than staying
PENDING forever as a purged plain message's does), and counted in the number returned.

``celery purge`` on the command line empties the broker queues directly, without the
control API, and does not reach them (docs/howto/operate-pools.md).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from celery.app import control

from pools.celery import messages
from pools.core import admission
from pools.models import QueueEntry

REASON = "purged"
_original_purge: Callable[..., int] | None = None


def install() -> None:
    """Wrap ``Control.purge`` (once per process)."""
    global _original_purge
    if _original_purge is not None:
        return
    _original_purge = control.Control.purge

    def purge(self: Any, connection: Any = None) -> int:
        assert _original_purge is not None
        count = _original_purge(self, connection=connection)
        return int(count or 0) + purge_waiting(consumed_queues(self.app))

    control.Control.purge = purge  # type: ignore[method-assign]


def consumed_queues(app: Any) -> set[str]:
    """Names of the queues ``app.control.purge()`` empties (the ones the app consumes)."""
    queues = app.amqp.queues
    return set((queues.consume_from or queues).keys())


def purge_waiting(queues: Collection[str]) -> int:
    """Cancel every waiting pooled call routed to one of ``queues``; how many."""
    ids = [
        queue_id
        for queue_id, options in QueueEntry.objects.waiting()
        .values_list("queue_id", "options")
        .iterator(chunk_size=2000)
        if _routed_to(options, queues)
    ]
    return admission.cancel_waiting(ids, reason=REASON) if ids else 0


def _routed_to(options: Any, queues: Collection[str]) -> bool:
    """Whether a held message goes to one of ``queues`` (read without decoding its body)."""
    data = options.get(messages.OPTION_KEY) if isinstance(options, dict) else None
    if not isinstance(data, dict):
        return False
    names = [data.get("routing_key"), *(data.get("declare") or ())]
    return any(name in queues for name in names if name)
