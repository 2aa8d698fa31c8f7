"""Pool definitions from ``POOLS["DEFINITIONS"]``: validation and sync to the database."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.utils import timezone

from pools import conf
from pools.core import admission, events, locking
from pools.exceptions import (
    PoolConfigurationError,
    PoolDefinedInSettings,
    PoolInUse,
    UnknownPool,
)
from pools.models import TERMINAL_STATES, Demand, EventKind, Pool
from pools.specs import validate_pool_name, validate_slots

_FIELDS = {"slots", "max_queued", "paused", "description"}


@dataclass(frozen=True, kw_only=True)
class PoolDefinition:
    """One pool as declared in settings."""

    name: str
    slots: int
    max_queued: int | None = None
    paused: bool = False
    description: str = ""


def parse(name: str, raw: Any) -> PoolDefinition:
    """Validate one ``DEFINITIONS`` item; raises ``PoolConfigurationError`` with the fix."""
    validate_pool_name(name)
    if not isinstance(raw, dict):
        raise PoolConfigurationError(
            f"POOLS['DEFINITIONS'][{name!r}] must be a dict such as {{'slots': 4}}, got {raw!r}."
        )
    unknown = set(raw) - _FIELDS
    if unknown:
        raise PoolConfigurationError(
            f"POOLS['DEFINITIONS'][{name!r}] has unknown key(s) {sorted(unknown)}; "
            f"allowed: {sorted(_FIELDS)}."
        )
    if "slots" not in raw:
        raise PoolConfigurationError(f"POOLS['DEFINITIONS'][{name!r}] needs 'slots'.")
    slots = validate_slots(raw["slots"], what=f"POOLS['DEFINITIONS'][{name!r}]['slots']")
    max_queued = raw.get("max_queued")
    if max_queued is not None:
        max_queued = validate_slots(
            max_queued, what=f"POOLS['DEFINITIONS'][{name!r}]['max_queued']"
        )
    return PoolDefinition(
        name=name,
        slots=slots,
        max_queued=max_queued,
        paused=bool(raw.get("paused", False)),
        description=str(raw.get("description", "")),
    )


def declared() -> list[PoolDefinition]:
    """Every pool declared in settings, validated."""
    return [parse(name, raw) for name, raw in sorted(conf.get().DEFINITIONS.items())]


@dataclass(frozen=True, kw_only=True)
class SyncReport:
    """What :func:`sync` did."""

    created: list[str]
    updated: list[str]
    unchanged: list[str]


def sync() -> SyncReport:
    """Create or update the pools declared in settings (pools made in the admin are kept)."""

    created: list[str] = []
    updated: list[str] = []
    unchanged: list[str] = []
    now = timezone.now()
    with transaction.atomic():
        for d in declared():
            pool, was_created = Pool.objects.get_or_create(
                name=d.name,
                defaults={
                    "slots": d.slots,
                    "max_queued": d.max_queued,
                    "paused": d.paused,
                    "description": d.description,
                    "defined_in_settings": True,
                },
            )
            if was_created:
                created.append(d.name)
                continue
            wanted = {
                "slots": d.slots,
                "max_queued": d.max_queued,
                "paused": d.paused,
                "description": d.description,
                "defined_in_settings": True,
            }
            if all(getattr(pool, k) == v for k, v in wanted.items()):
                unchanged.append(d.name)
                continue
            before = pool.slots
            Pool.objects.filter(pk=pool.pk).update(**wanted, updated_at=now)
            updated.append(d.name)
            if before != d.slots:
                events.record_pool(
                    EventKind.CAPACITY_CHANGED,
                    d.name,
                    at=now,
                    detail={"from": before, "to": d.slots},
                )
    if updated:
        admission.admit(updated)
    return SyncReport(created=created, updated=updated, unchanged=unchanged)


def pool_saved(pool: Pool, *, old_slots: int | None, old_paused: bool | None) -> None:
    """After a pool was created or edited (admin, API): log the change and run admission."""

    now = timezone.now()
    if old_slots is not None and old_slots != pool.slots:
        events.record_pool(
            EventKind.CAPACITY_CHANGED,
            pool.name,
            at=now,
            detail={"from": old_slots, "to": pool.slots},
        )
    if old_paused is not None and old_paused != pool.paused:
        events.record_pool(
            EventKind.CAPACITY_CHANGED, pool.name, at=now, detail={"paused": pool.paused}
        )
    transaction.on_commit(lambda: admission.admit([pool.name]))


def set_paused(name: str, paused: bool) -> bool:
    """Pause (admit nothing; entries keep their place) or resume pool ``name``.

    Returns True if the pool's state changed. The change is logged as a capacity event;
    resuming runs admission after commit. Raises :class:`UnknownPool` for an unknown name.
    """

    now = timezone.now()
    with transaction.atomic():
        changed = (
            Pool.objects.filter(name=name)
            .exclude(paused=paused)
            .update(paused=paused, updated_at=now)
        )
        if not changed and not Pool.objects.filter(name=name).exists():
            raise UnknownPool(name)
        if changed:
            events.record_pool(EventKind.CAPACITY_CHANGED, name, at=now, detail={"paused": paused})
            if not paused:
                transaction.on_commit(lambda: admission.admit([name]))
    return bool(changed)


# --------------------------------------------------------------------------- pool CRUD (API)

#: Fields of a pool that :func:`update_pool` may change (the name is fixed: entries name it).
EDITABLE = ("slots", "max_queued", "paused", "description")


def validate_fields(values: dict[str, Any]) -> dict[str, Any]:
    """Check pool fields with the same rules as settings; returns them normalized.

    Raises ``PoolConfigurationError`` naming the field (``exc.field``) and the fix.
    """
    out: dict[str, Any] = {}
    for key, value in values.items():
        try:
            if key == "name":
                out[key] = validate_pool_name(value)
            elif key == "slots":
                out[key] = validate_slots(value, what="slots")
            elif key == "max_queued":
                out[key] = None if value is None else validate_slots(value, what="max_queued")
            elif key == "paused":
                if not isinstance(value, bool):
                    raise PoolConfigurationError(f"paused must be true or false, got {value!r}.")
                out[key] = value
            elif key == "description":
                out[key] = str(value)
            else:
                raise PoolConfigurationError(
                    f"Unknown pool field {key!r}; allowed: name, {', '.join(EDITABLE)}."
                )
        except PoolConfigurationError as exc:
            exc.field = key
            raise
    return out


def create_pool(
    *,
    name: str,
    slots: int,
    max_queued: int | None = None,
    paused: bool = False,
    description: str = "",
) -> Pool:
    """Create a pool (admin, API). Raises ``PoolConfigurationError`` (bad field, name taken)."""
    values = validate_fields(
        {
            "name": name,
            "slots": slots,
            "max_queued": max_queued,
            "paused": paused,
            "description": description,
        }
    )
    with transaction.atomic():
        if Pool.objects.filter(name=name).exists():
            exc = PoolConfigurationError(
                f"A pool named {name!r} already exists; pick another name."
            )
            exc.field = "name"
            raise exc
        pool = Pool.objects.create(**values)
        pool_saved(pool, old_slots=None, old_paused=None)
    return pool


def update_pool(name: str, **changes: Any) -> Pool:
    """Change a pool's ``slots``, ``max_queued``, ``paused`` or ``description`` under its lock.

    Logs capacity/pause changes and runs admission after commit (:func:`pool_saved`).
    Raises ``UnknownPool``, ``PoolConfigurationError`` or ``PoolUnavailable``.
    """

    if "name" in changes and changes["name"] != name:
        exc = PoolConfigurationError(
            "A pool cannot be renamed: entries name it. Create a new pool instead."
        )
        exc.field = "name"
        raise exc
    changes.pop("name", None)
    values = validate_fields(changes)
    with locking.locked_pools([name]) as locked:
        pool = locked.get(name)
        if pool is None:
            raise UnknownPool(name)
        old_slots, old_paused = pool.slots, pool.paused
        for key, value in values.items():
            setattr(pool, key, value)
        pool.save(update_fields=[*values, "updated_at"])
        pool_saved(pool, old_slots=old_slots, old_paused=old_paused)
    return pool


def delete_pool(name: str) -> None:
    """Delete a pool made in the admin or the API, with the finished history of its entries.

    Refused with ``PoolDefinedInSettings`` for a pool of ``POOLS['DEFINITIONS']`` and with
    ``PoolInUse`` while entries wait for it or hold its slots (checked under its lock).
    Raises ``UnknownPool`` or ``PoolUnavailable``.
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
        # Finished entries keep their rows in other pools; their demand here goes with it.
        Demand.objects.filter(pool_id=pool.pk).delete()
        pool.delete()
