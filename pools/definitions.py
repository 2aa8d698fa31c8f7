"""Pool definitions from ``POOLS["DEFINITIONS"]``: validation and sync to the database."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.utils import timezone

from pools import conf, events
from pools.exceptions import PoolConfigurationError
from pools.models import EventKind, Pool
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
    from pools import admission

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
    from pools import admission

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
