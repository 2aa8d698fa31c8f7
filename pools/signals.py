"""Django signals for every lifecycle event, sent after the transaction that caused it commits.

Every signal is sent with ``sender=PoolEvent`` and ``event=<PoolEvent>``.
"""

from __future__ import annotations

from django.dispatch import Signal

#: An entry joined a pool's line.
entry_enqueued = Signal()
#: An entry was admitted: its slots are held and its message is about to be published.
entry_admitted = Signal()
#: A worker started an admitted entry.
entry_started = Signal()
#: An attempt finished (succeeded, failed, retried) and released its slots.
entry_settled = Signal()
#: A held entry went back to the line (lease lapsed, publish failed).
entry_requeued = Signal()
#: A waiting entry passed its deadline.
entry_expired = Signal()
#: A waiting entry was cancelled.
entry_cancelled = Signal()
#: Stopping a held (admitted or running) entry was asked for (``cancel(terminate=True)``);
#: its slots are released when the worker has stopped it (``entry_settled``).
entry_terminate_requested = Signal()
#: A submission was refused (pool full, budget, ...).
entry_rejected = Signal()
#: A delivery was skipped (no claim, stale fencing token).
delivery_skipped = Signal()
#: A pool's configuration changed: capacity (``detail``: ``from``, ``to``), pause state
#: (``paused``) or another field (``field``, ``from``, ``to``). ``event.actor`` names the
#: user when the change came from the admin or the REST API.
pool_changed = Signal()
#: A pool was created (admin, API, or a per-key pool on first use; ``detail``: its fields).
pool_created = Signal()
#: A pool was deleted (admin, API, or an idle per-key pool retired by the sweep).
pool_deleted = Signal()

BY_KIND: dict[str, Signal] = {
    "enqueued": entry_enqueued,
    "admitted": entry_admitted,
    "started": entry_started,
    "settled": entry_settled,
    "requeued": entry_requeued,
    "expired": entry_expired,
    "cancelled": entry_cancelled,
    "terminate": entry_terminate_requested,
    "rejected": entry_rejected,
    "skipped": delivery_skipped,
    "capacity": pool_changed,
    "pool_created": pool_created,
    "pool_deleted": pool_deleted,
}
