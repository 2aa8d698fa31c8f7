"""Pools made on first use: per-key pools from ``POOLS["TEMPLATES"]`` and the pools of
workflow caps (``run-cap:<root>``, ``task-cap:<task>``), retired by the sweep once idle.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from pools import conf, pool_fields
from pools.core import overrides
from pools.core.capacity import configured_slots, pool_saved
from pools.core.declarations import template_for
from pools.core.pool_crud import delete_pool, update_pool
from pools.exceptions import (
    PoolConfigurationError,
    PoolDefinedInSettings,
    PoolInUse,
    UnknownPool,
)
from pools.models import Pool
from pools.states import DELAYED, HELD_STATES, EntryState

#: Per-key pools retired per sweep (the next sweep takes the rest).
RETIRE_BATCH = 100
#: Demand states of unfinished entries (a pool with such a row is in use).
_UNFINISHED_DEMAND = (EntryState.WAITING, *HELD_STATES, DELAYED)


def ensure_pool(name: str, pattern: str) -> Pool:
    """The per-key pool ``name``, created from the template of ``pattern`` on first use.

    Its ``slots`` / ``rate`` / ``max_queued`` are its overrides, else the template's values
    callable's, else the template's (:mod:`pools.core.overrides`).

    Race-safe: concurrent first uses create one pool (the unique name decides; the loser
    reads the winner's row). An existing pool of that name is used as it is, whatever made
    it. The creation is logged as a ``pool_created`` event.
    """
    pool = Pool.objects.filter(name=name).first()
    if pool is not None:
        return pool
    template = template_for(pattern)
    limits = overrides.limits_for(name, pattern)
    for _attempt in range(3):
        try:
            with transaction.atomic():
                pool = Pool.objects.create(
                    name=name,
                    **{
                        key: getattr(template, key)
                        for key in pool_fields.names(pool_fields.TEMPLATE)
                        if key not in limits.values
                    },
                    **limits.values,
                    template=pattern,
                )
                pool_saved(
                    pool,
                    old_slots=None,
                    old_paused=None,
                    created=True,
                    created_detail=overrides.creation_detail(limits),
                )
            overrides.applied_after_create(pool, limits.override)
            return pool
        except IntegrityError:
            # Another first use won (or a retirement is deleting it: read again, retry).
            pool = Pool.objects.filter(name=name).first()
            if pool is not None:
                return pool
    raise PoolConfigurationError(f"Could not create the per-key pool {name!r}; try again.")


def ensure_cap_pool(name: str, slots: int, *, template: str, rate: str = "") -> Pool:
    """The pool of a workflow cap (``run-cap:<root>``, ``task-cap:<task>``), made on first use.

    Created with ``slots``, ``rate`` (stored form; a task's ``@pooled(rate=...)``) and
    ``template`` (so the sweep retires it once idle, like a per-key pool). An existing
    pool whose configured capacity or rate differs (a task's ``max_running`` or ``rate``
    changed in the code) gets the new values through :func:`update_pool` (a capacity
    change drains; a rate change starts from empty windows). Race-safe as
    :func:`ensure_pool`.
    """
    for _attempt in range(3):
        pool = Pool.objects.filter(name=name).first()
        if pool is not None:
            changes: dict[str, Any] = {}
            if configured_slots(pool) != slots:
                changes["slots"] = slots
            if pool.rate != rate:
                changes["rate"] = rate
            return update_pool(name, **changes) if changes else pool
        try:
            with transaction.atomic():
                pool = Pool.objects.create(name=name, slots=slots, rate=rate, template=template)
                pool_saved(pool, old_slots=None, old_paused=None, created=True)
            return pool
        except IntegrityError:
            continue  # another first use won: read its row
    raise PoolConfigurationError(f"Could not create the cap pool {name!r}; try again.")


def retire_idle(now: datetime | None = None) -> list[str]:
    """Delete per-key pools with no unfinished entry and no use for ``TEMPLATE_IDLE_SECONDS``.

    Run by the sweep. Each deletion re-checks under the pool's lock (a submit in between
    keeps the pool); returns the names deleted.
    """
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=conf.get().TEMPLATE_IDLE_SECONDS)
    candidates = list(
        Pool.objects.filter(template__gt="", created_at__lt=cutoff)
        .exclude(demands__state__in=_UNFINISHED_DEMAND)
        .values_list("name", flat=True)
        .distinct()[:RETIRE_BATCH]
    )
    retired = []
    for name in candidates:
        try:
            if delete_pool(name, idle_since=cutoff):
                retired.append(name)
        except (PoolInUse, UnknownPool, PoolDefinedInSettings):
            continue
    return retired
