"""Pool services of the admin and the REST API: create, update and delete a pool.

Fields are checked with the pool field table (:mod:`pools.pool_fields`), the rules of
settings; every change is logged with the acting user (``actor``) when the caller passes
one.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import transaction
from django.utils import timezone

from pools import conf, pool_fields
from pools.core import events, locking, strategies, windows
from pools.core.capacity import change_slots, pool_saved
from pools.exceptions import (
    PoolConfigurationError,
    PoolDefinedInSettings,
    PoolInUse,
    UnknownPool,
)
from pools.models import Demand, OwedWork, Pool, PoolOverride
from pools.pool_fields import OverflowPolicy, PausedPolicy, Strategy
from pools.states import TERMINAL_STATES, EventKind


def create_pool(
    *,
    name: str,
    slots: int,
    max_queued: int | None = None,
    paused: bool = False,
    description: str = "",
    overflow: str = OverflowPolicy.REJECT,
    paused_policy: str = PausedPolicy.QUEUE,
    strategy: str = Strategy.PRIORITY,
    aging_seconds: int | None = None,
    spend_cap: float | None = None,
    rate: Any = "",
    actor: str | None = None,
) -> Pool:
    """Create a pool (admin, API). Raises ``PoolConfigurationError`` (bad field, name taken)."""
    values = pool_fields.check_fields(
        {
            "name": name,
            "slots": slots,
            "max_queued": max_queued,
            "paused": paused,
            "description": description,
            "overflow": overflow,
            "paused_policy": paused_policy,
            "strategy": strategy,
            "aging_seconds": aging_seconds,
            "spend_cap": spend_cap,
            "rate": rate,
        }
    )
    pool_fields.check_order(values["strategy"], values["aging_seconds"])
    with transaction.atomic():
        if Pool.objects.filter(name=name).exists():
            exc = PoolConfigurationError(
                f"A pool named {name!r} already exists; pick another name."
            )
            exc.field = "name"
            raise exc
        pool = Pool.objects.create(**values)
        pool_saved(pool, old_slots=None, old_paused=None, actor=actor, created=True)
    return pool


def update_pool(
    name: str, *, actor: str | None = None, as_override: bool = True, **changes: Any
) -> Pool:
    """Change a pool's fields (:data:`pools.pool_fields.EDITABLE`) under its lock.

    A new ``slots`` goes through :func:`change_slots` (it drains while entries wait).
    Logs capacity/pause changes and runs admission after commit (:func:`pool_saved`).
    On a per-key pool (made from a ``POOLS["TEMPLATES"]`` pattern) a new ``slots``,
    ``rate`` or ``max_queued`` is saved as an override that outlives the pool
    (:mod:`pools.core.overrides`), unless ``as_override`` is False (the template's own
    values being applied).
    Raises ``UnknownPool``, ``PoolConfigurationError`` or ``PoolUnavailable``.
    """

    if "name" in changes and changes["name"] != name:
        exc = PoolConfigurationError(
            "A pool cannot be renamed: entries name it. Create a new pool instead."
        )
        exc.field = "name"
        raise exc
    changes.pop("name", None)
    values = pool_fields.check_fields(changes)
    limits = {k: v for k, v in values.items() if k in pool_fields.LIMIT_FIELDS}
    with locking.locked_pools([name]) as locked:
        pool = locked.get(name)
        if pool is None:
            raise UnknownPool(name)
        if as_override and limits and pool.template in conf.get().TEMPLATES:
            save_override(name, pool.template, limits, actor=actor)
        old_slots, old_paused = pool.slots, pool.paused
        old = {key: getattr(pool, key) for key in values}
        slots = values.pop("slots", None)
        reorder = any(
            k in values and getattr(pool, k) != values[k] for k in pool_fields.ORDER_FIELDS
        )
        if "rate" in values and values["rate"] != pool.rate:
            windows.reset(pool)  # new rates start from empty windows
        for key, value in values.items():
            setattr(pool, key, value)
        if pool.backoff_until is not None and not pool.paused:
            # Unpausing a pool in backoff ends the backoff (pools.core.backoffs).
            pool.backoff_until = None
            values["backoff_until"] = None
        pool_fields.check_order(pool.strategy, pool.aging_seconds)
        pool.save(update_fields=[*values, "updated_at"])
        if reorder:  # logged by pool_saved, with the actor (a "field" capacity event)
            strategies.rerank(pool)
        if slots is not None:
            change_slots(pool, slots, timezone.now(), actor=actor)
        pool_saved(pool, old_slots=old_slots, old_paused=old_paused, actor=actor, old=old)
    return pool


def save_override(
    name: str, pattern: str, values: dict[str, Any], *, actor: str | None = None
) -> PoolOverride:
    """Merge limit ``values`` (checked) into the override row of per-key pool ``name``,
    and log who set what (a ``capacity`` event with ``override``). The pool itself is not
    changed here (:func:`update_pool` does, :mod:`pools.core.overrides` calls it)."""
    # The row first (get_or_create settles two first overrides of a name), then its lock.
    PoolOverride.objects.get_or_create(pool=name, defaults={"template": pattern})
    with locking.locked_override(name) as locked:
        row = locked or PoolOverride(pool=name)
        row.values = {**row.values, **values}
        row.template, row.actor = pattern, actor or ""
        row.save()
        events.record_pool(
            EventKind.CAPACITY_CHANGED,
            name,
            at=timezone.now(),
            detail={"override": values, "template": pattern},
            actor=actor,
        )
    return row


def delete_pool(name: str, *, actor: str | None = None, idle_since: datetime | None = None) -> bool:
    """Delete a pool made in the admin or the API, with the finished history of its entries.

    Refused with ``PoolDefinedInSettings`` for a pool of ``POOLS['DEFINITIONS']`` and with
    ``PoolInUse`` while entries wait for it or hold its slots (checked under its lock).
    Raises ``UnknownPool`` or ``PoolUnavailable``. With ``idle_since`` (the retirement of
    per-key pools) a pool used or created after that time is kept: returns False.
    """

    with locking.locked_pools([name]) as locked:
        pool = locked.get(name)
        if pool is None:
            raise UnknownPool(name)
        if pool.defined_in_settings or name in conf.get().DEFINITIONS:
            raise PoolDefinedInSettings(name)
        active = Demand.objects.filter(pool_id=pool.pk).exclude(state__in=TERMINAL_STATES).count()
        if active:
            raise PoolInUse(name, active)
        if idle_since is not None and _used_since(pool, idle_since):
            return False
        # Finished entries keep their rows in other pools; their demand here goes with it.
        Demand.objects.filter(pool_id=pool.pk).delete()
        # Work owed to its lock holder (no foreign key: see OwedWork) goes with it.
        OwedWork.objects.filter(pool_id=pool.pk).delete()
        pool.delete()
        events.record_pool(
            EventKind.POOL_DELETED,
            name,
            at=timezone.now(),
            detail={"template": pool.template} if pool.template else {},
            actor=actor,
        )
    return True


def _used_since(pool: Pool, since: datetime) -> bool:
    """True if ``pool`` was created, or had an entry enqueued or finished, after ``since``."""
    if pool.created_at >= since:
        return True
    rows = Demand.objects.filter(pool_id=pool.pk)
    return (
        rows.filter(enqueued_at__gte=since).exists()
        or rows.filter(entry__finished_at__gte=since).exists()
    )
