"""Sync from settings: the pools of ``POOLS["DEFINITIONS"]`` and ``POOLS["DEFAULT_POOL"]``
created or updated in the database, and those removed from settings retired.

Run on ``migrate`` and by ``manage.py pools sync``; pools made in the admin or the API are
kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from django.db import transaction
from django.utils import timezone

from pools import conf, pool_fields
from pools.core import admission, events, locking, overrides, strategies, windows
from pools.core.capacity import change_slots, configured_slots, log_pause
from pools.core.declarations import declared
from pools.models import Demand, Pool
from pools.states import TERMINAL_STATES, EventKind

#: The fields settings set besides ``slots`` (a capacity change drains: ``change_slots``).
_SYNCED = tuple(name for name in pool_fields.names(pool_fields.SETTINGS) if name != "slots")


@dataclass(frozen=True, kw_only=True)
class SyncReport:
    """What :func:`sync` did."""

    created: list[str]
    updated: list[str]
    unchanged: list[str]
    #: Pools whose capacity change waits for their queue to drain (``pending_slots``).
    draining: list[str] = field(default_factory=list)
    #: Pools removed from settings and deleted (they had no unfinished entry).
    deleted: list[str] = field(default_factory=list)
    #: Pools removed from settings that still hold or queue work: ``retiring``, deleted
    #: once empty (by the sweep), with how many unfinished entries they have.
    retiring: dict[str, int] = field(default_factory=dict)
    #: Per-key pools given their template's new values (fields without an override).
    per_key: list[str] = field(default_factory=list)


def sync() -> SyncReport:
    """Create or update the pools declared in settings (pools made in the admin are kept).

    A changed ``slots`` goes through :func:`change_slots` (it drains while entries wait).
    A pool that was declared in settings and no longer is gets deleted when it has no
    unfinished entry, else marked ``retiring`` and deleted by the sweep once empty.
    Existing per-key pools take their template's limit values for the fields they do not
    override (:func:`pools.core.overrides.apply_templates`).
    """

    created: list[str] = []
    updated: list[str] = []
    unchanged: list[str] = []
    draining: list[str] = []
    now = timezone.now()
    declared_now = declared()
    with transaction.atomic():
        for d in declared_now:
            pool, was_created = Pool.objects.get_or_create(
                name=d.name,
                defaults={
                    "slots": d.slots,
                    **{key: getattr(d, key) for key in _SYNCED},
                    "defined_in_settings": True,
                },
            )
            if was_created:
                # Not logged: settings are the record of settings pools (their capacity
                # changes on sync are logged, below).
                created.append(d.name)
                continue
            wanted = {
                **{key: getattr(d, key) for key in _SYNCED},
                "defined_in_settings": True,
                "retiring": False,
            }
            if pool.backoff_until is not None:
                # A backoff outlives a restart's sync; a pool declared paused stays paused
                # after it (pools.core.backoffs).
                wanted["paused"] = True
                if d.paused:
                    wanted["backoff_until"] = None
            if configured_slots(pool) == d.slots and all(
                getattr(pool, k) == v for k, v in wanted.items()
            ):
                unchanged.append(d.name)
                continue
            with locking.locked_pools([d.name]) as locked:
                pool = locked[d.name]
                old_paused = pool.paused
                reorder = any(getattr(pool, k) != wanted[k] for k in pool_fields.ORDER_FIELDS)
                if pool.rate != d.rate:
                    windows.reset(pool)  # new rates start from empty windows
                for key, value in wanted.items():
                    setattr(pool, key, value)
                pool.save(update_fields=[*wanted, "updated_at"])
                if reorder:
                    _reorder(pool, now)
                change_slots(pool, d.slots, now)
                log_pause(pool, old_paused, now)
            updated.append(d.name)
            if pool.pending_slots is not None:
                draining.append(d.name)
    deleted, retiring = _retire_removed({d.name for d in declared_now}, now)
    if updated:
        admission.admit(updated)
    # Per-key pools: the template's (or its values callable's) limits for the fields
    # without an override; an override set at runtime is never overwritten.
    per_key = overrides.apply_templates()
    return SyncReport(
        created=created,
        updated=updated,
        unchanged=unchanged,
        draining=draining,
        deleted=deleted,
        retiring=retiring,
        per_key=per_key,
    )


def _reorder(pool: Pool, now: datetime) -> None:
    """The pool's order changed on sync (under its lock): new places for its backlog, and
    an event (:func:`update_pool` logs its own through :func:`pool_saved`)."""
    moved = strategies.rerank(pool)
    events.record_pool(
        EventKind.CAPACITY_CHANGED,
        pool.name,
        at=now,
        detail={"strategy": pool.strategy, "aging_seconds": pool.aging_seconds, "moved": moved},
    )


def _retire_removed(declared_names: set[str], now: datetime) -> tuple[list[str], dict[str, int]]:
    """Pools once declared in settings and now gone: delete the empty ones, retire the rest."""
    deleted: list[str] = []
    retiring: dict[str, int] = {}
    gone = (
        Pool.objects.filter(defined_in_settings=True)
        .exclude(name__in=declared_names)
        .values_list("name", flat=True)
    )
    for name in sorted(gone):
        active = retire(name, now)
        if active:
            retiring[name] = active
        else:
            deleted.append(name)
    return deleted, retiring


def retire(name: str, now: datetime | None = None) -> int:
    """Delete pool ``name`` if it has no unfinished entry, else mark it ``retiring``.

    Returns the number of unfinished entries (0: deleted). Under the pool's lock, so no
    entry can join it meanwhile; a retiring pool refuses nothing by itself (its tasks
    are expected to be gone from the code), the sweep calls this again until it is empty.
    """
    now = now or timezone.now()
    with locking.locked_pools([name]) as locked:
        pool = locked.get(name)
        if pool is None:
            return 0
        active = Demand.objects.filter(pool_id=pool.pk).exclude(state__in=TERMINAL_STATES).count()
        if active:
            if not pool.retiring:
                Pool.objects.filter(pk=pool.pk).update(retiring=True, updated_at=now)
                events.record_pool(
                    EventKind.CAPACITY_CHANGED,
                    name,
                    at=now,
                    detail={"retiring": True, "unfinished": active},
                )
            return active
        Demand.objects.filter(pool_id=pool.pk).delete()
        pool.delete()
    return 0


def sweep_retiring() -> list[str]:
    """Delete the retiring pools that have become empty (sweep); returns their names."""
    names = list(Pool.objects.filter(retiring=True).values_list("name", flat=True))
    return [name for name in names if name not in conf.get().DEFINITIONS and not retire(name)]
