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
#: A submission was refused (pool full, budget, ...).
entry_rejected = Signal()
#: A delivery was skipped (no claim, stale fencing token).
delivery_skipped = Signal()
#: A pool's capacity or pause state changed.
pool_changed = Signal()

BY_KIND: dict[str, Signal] = {
    "enqueued": entry_enqueued,
    "admitted": entry_admitted,
    "started": entry_started,
    "settled": entry_settled,
    "requeued": entry_requeued,
    "expired": entry_expired,
    "cancelled": entry_cancelled,
    "rejected": entry_rejected,
    "skipped": delivery_skipped,
    "capacity": pool_changed,
}
