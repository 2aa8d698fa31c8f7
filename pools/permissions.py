"""The permissions of every pools surface (REST API, admin card, admin actions), in one place.

Each action asks for the same permission wherever it is offered; a surface that hides a
control for lack of it shows :func:`missing` instead. The table is in
docs/reference/security.md.
"""

from __future__ import annotations

#: Read the pools, their lines and entries (REST reads, the card, a pool's page, metrics).
VIEW_POOL = "pools.view_pool"
#: Open queue entries and their run panels.
VIEW_ENTRY = "pools.view_queueentry"
#: Cancel entries: the REST cancel endpoint, the card's Cancel, the entry list's actions.
CANCEL_ENTRY = "pools.cancel_queueentry"
#: Read the event log (the admin's event list and ``GET events/``).
VIEW_EVENT = "pools.view_poolevent"
#: Start a periodic task now (``POST jobs/<name>/start``).
START_JOB = "pools.start_job"

#: What each permission is called in the admin's user form.
LABELS = {
    VIEW_POOL: "Can view resource pool",
    VIEW_ENTRY: "Can view queue entry",
    CANCEL_ENTRY: "Can cancel queue entries",
    VIEW_EVENT: "Can view pool event",
    START_JOB: "Can start a periodic task now (manual start)",
}


def missing(action: str, perm: str) -> str:
    """The short text a surface shows where it hides ``action`` for lack of ``perm``."""
    label = LABELS.get(perm)
    named = f'"{label}" ({perm})' if label else perm
    return f"{action} needs the permission {named}; ask an administrator for it."
