"""A pool's capacity and pause: capacity changes that drain, pause and resume, the drain's
progress, and what follows a pool's creation or edit (events, an admission pass).

Every change is logged in the event log (:mod:`pools.core.events`) with the acting user
(``actor``, a username) when the caller passes one: the admin and the REST API do;
settings sync, the sweep and code leave it empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from pools.core import admission, events
from pools.exceptions import UnknownPool
from pools.models import Demand, Pool
from pools.states import EventKind


def configured_slots(pool: Pool) -> int:
    """The capacity last asked for: the pending one while the pool drains, else ``slots``."""
    return pool.slots if pool.pending_slots is None else pool.pending_slots


def change_slots(pool: Pool, slots: int, now: datetime, *, actor: str | None = None) -> None:
    """Ask for a new capacity; the caller holds the pool's lock.

    With entries in line the new value waits in ``pending_slots``: the old capacity stays
    in effect while those entries drain, new enqueues are refused (``PoolDraining``),
    and the admission pass that empties the line applies it (with an event). With an
    empty line it takes effect now. Asking for the capacity in effect ends a drain. See
    docs/reference/pool-policies.md.
    """
    if slots == configured_slots(pool):
        return
    before = pool.slots
    if slots == pool.slots:  # back to the capacity in effect: nothing left to drain
        pool.pending_slots = None
        detail: dict[str, Any] = {"from": before, "to": slots, "drain_cancelled": True}
    elif Demand.objects.line(pool.pk).exists():
        pool.pending_slots = slots
        left = Demand.objects.line(pool.pk).count()
        detail = {"from": before, "to": slots, "draining": True, "left": left}
    else:
        pool.slots, pool.pending_slots = slots, None
        detail = {"from": before, "to": slots}
    Pool.objects.filter(pk=pool.pk).update(
        slots=pool.slots, pending_slots=pool.pending_slots, updated_at=now
    )
    events.record_pool(EventKind.CAPACITY_CHANGED, pool.name, at=now, detail=detail, actor=actor)


def log_pause(pool: Pool, old_paused: bool | None, now: datetime, actor: str | None = None) -> None:
    """Log a change of ``paused`` as a capacity event."""
    if old_paused is not None and old_paused != pool.paused:
        events.record_pool(
            EventKind.CAPACITY_CHANGED,
            pool.name,
            at=now,
            detail={"paused": pool.paused},
            actor=actor,
        )


def set_paused(name: str, paused: bool, *, actor: str | None = None) -> bool:
    """Pause (admit nothing; entries keep their place) or resume pool ``name``.

    Returns True if the pool's state changed. The change is logged as a capacity event;
    resuming runs admission after commit. Raises :class:`UnknownPool` for an unknown name.
    A pool in backoff (:mod:`pools.core.backoffs`) is paused already: pausing it keeps it
    paused after the backoff's end, resuming it ends the backoff now.
    """

    now = timezone.now()
    with transaction.atomic():
        changed = (
            Pool.objects.filter(name=name)
            .filter(~Q(paused=paused) | Q(backoff_until__isnull=False))
            .update(paused=paused, backoff_until=None, updated_at=now)
        )
        if not changed and not Pool.objects.filter(name=name).exists():
            raise UnknownPool(name)
        if changed:
            events.record_pool(
                EventKind.CAPACITY_CHANGED, name, at=now, detail={"paused": paused}, actor=actor
            )
            if not paused:
                transaction.on_commit(lambda: admission.admit([name]))
    return bool(changed)


@dataclass(frozen=True, kw_only=True)
class DrainProgress:
    """Where a pool's capacity change stands (``manage.py pools drain``)."""

    pool: str
    #: Capacity in effect.
    capacity: int
    #: The capacity asked for (equal to ``capacity`` when not draining).
    slots: int
    draining: bool
    #: Entries in line (queued before the change, while draining).
    left: int
    held: int


def drain_progress(name: str) -> DrainProgress:
    """The drain state of pool ``name``; raises :class:`UnknownPool`."""
    pool = Pool.objects.filter(name=name).first()
    if pool is None:
        raise UnknownPool(name)
    return DrainProgress(
        pool=name,
        capacity=pool.slots,
        slots=configured_slots(pool),
        draining=pool.pending_slots is not None,
        left=Demand.objects.line(pool.pk).count(),
        held=pool.held,
    )


def pool_saved(
    pool: Pool,
    *,
    old_slots: int | None,
    old_paused: bool | None,
    actor: str | None = None,
    old: dict[str, Any] | None = None,
    created: bool = False,
    created_detail: dict[str, Any] | None = None,
) -> None:
    """After a pool was created or edited (admin, API): log the change and run admission.

    A capacity change is logged by :func:`change_slots` (``old_slots`` is kept for
    callers). ``old`` holds the edited fields' values before the change (``max_queued``,
    ``description``, policies): a change of one of them is logged too, as a ``capacity``
    event whose detail names the field. ``created`` logs a ``pool_created`` event with
    the pool's fields (and ``created_detail``).
    """

    now = timezone.now()
    if created:
        events.record_pool(
            EventKind.POOL_CREATED,
            pool.name,
            at=now,
            detail={
                "slots": pool.slots,
                "max_queued": pool.max_queued,
                "paused": pool.paused,
                **({"template": pool.template} if pool.template else {}),
                **(created_detail or {}),
            },
            actor=actor,
        )
    log_pause(pool, old_paused, now, actor)
    for key, before in (old or {}).items():
        after = getattr(pool, key)
        if key not in ("slots", "paused") and before != after:
            events.record_pool(
                EventKind.CAPACITY_CHANGED,
                pool.name,
                at=now,
                detail={"field": key, "from": before, "to": after},
                actor=actor,
            )
    transaction.on_commit(lambda: admission.admit([pool.name]))
