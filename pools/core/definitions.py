"""Pool definitions: ``POOLS["DEFINITIONS"]`` and its sync, the pool CRUD service functions,
and per-key pools made from ``POOLS["TEMPLATES"]`` on first use.

Every configuration change is logged in the event log (:mod:`pools.core.events`) with the
acting user (``actor``, a username) when the caller passes one: the admin and the REST API
do; settings sync, the sweep and code leave it empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from pools import conf
from pools.core import admission, events, locking
from pools.exceptions import (
    PoolConfigurationError,
    PoolDefinedInSettings,
    PoolInUse,
    UnknownPool,
)
from pools.models import DELAYED, HELD_STATES, TERMINAL_STATES, Demand, EntryState, EventKind, Pool
from pools.specs import validate_pool_name, validate_pool_pattern, validate_slots

_FIELDS = {"slots", "max_queued", "paused", "description"}
#: Per-key pools retired per sweep (the next sweep takes the rest).
RETIRE_BATCH = 100
#: Demand states of unfinished entries (a pool with such a row is in use).
_UNFINISHED_DEMAND = (EntryState.WAITING, *HELD_STATES, DELAYED)


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
    """Every pool declared in settings (``DEFINITIONS`` and ``DEFAULT_POOL``), validated."""
    pools = [parse(name, raw) for name, raw in sorted(conf.get().DEFINITIONS.items())]
    default = default_pool()
    if default is not None and default.name not in conf.get().DEFINITIONS:
        pools.append(
            PoolDefinition(name=default.name, slots=default.slots, max_queued=default.max_queued)
        )
    return pools


@dataclass(frozen=True, kw_only=True)
class DefaultPool:
    """The implicit default pool (``POOLS['DEFAULT_POOL']``)."""

    name: str
    slots: int
    #: Tasks without ``@pooled`` routed to one of these queues are admitted through the pool.
    queues: frozenset[str]
    max_queued: int | None = None


_DEFAULT_POOL_FIELDS = {"name", "slots", "queues", "max_queued"}


def parse_default_pool(raw: Any) -> DefaultPool:
    """Validate ``POOLS['DEFAULT_POOL']``; raises ``PoolConfigurationError`` with the fix."""
    where = "POOLS['DEFAULT_POOL']"
    if not isinstance(raw, dict):
        raise PoolConfigurationError(
            f"{where} must be a dict such as {{'name': 'default', 'slots': 128}}, got {raw!r}."
        )
    unknown = set(raw) - _DEFAULT_POOL_FIELDS
    if unknown:
        raise PoolConfigurationError(
            f"{where} has unknown key(s) {sorted(unknown)}; allowed: "
            f"{sorted(_DEFAULT_POOL_FIELDS)}."
        )
    if "slots" not in raw:
        raise PoolConfigurationError(f"{where} needs 'slots' (the capacity of the pool).")
    queues = raw.get("queues", ["celery"])
    if (
        isinstance(queues, str)
        or not isinstance(queues, list | tuple | set | frozenset)
        or not queues
        or not all(isinstance(q, str) and q for q in queues)
    ):
        raise PoolConfigurationError(
            f"{where}['queues'] must be a non-empty list of queue names such as ['celery'], "
            f"got {queues!r}."
        )
    max_queued = raw.get("max_queued")
    return DefaultPool(
        name=validate_pool_name(raw.get("name", "default")),
        slots=validate_slots(raw["slots"], what=f"{where}['slots']"),
        queues=frozenset(queues),
        max_queued=None
        if max_queued is None
        else validate_slots(max_queued, what=f"{where}['max_queued']"),
    )


def default_pool() -> DefaultPool | None:
    """The implicit default pool in effect, or None when it is off."""
    raw = conf.get().DEFAULT_POOL
    return None if raw is None else parse_default_pool(raw)


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
                # Not logged: settings are the record of settings pools (their capacity
                # changes on sync are logged, below).
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


def pool_saved(
    pool: Pool,
    *,
    old_slots: int | None,
    old_paused: bool | None,
    actor: str | None = None,
    old: dict[str, Any] | None = None,
    created: bool = False,
) -> None:
    """After a pool was created or edited (admin, API): log the change and run admission.

    ``old`` holds the edited fields' values before the change (``max_queued``,
    ``description``): a change of one of them is logged too, as a ``capacity`` event whose
    detail names the field. ``created`` logs a ``pool_created`` event with the pool's fields.
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
            },
            actor=actor,
        )
    if old_slots is not None and old_slots != pool.slots:
        events.record_pool(
            EventKind.CAPACITY_CHANGED,
            pool.name,
            at=now,
            detail={"from": old_slots, "to": pool.slots},
            actor=actor,
        )
    if old_paused is not None and old_paused != pool.paused:
        events.record_pool(
            EventKind.CAPACITY_CHANGED,
            pool.name,
            at=now,
            detail={"paused": pool.paused},
            actor=actor,
        )
    for field, before in (old or {}).items():
        after = getattr(pool, field)
        if field not in ("slots", "paused") and before != after:
            events.record_pool(
                EventKind.CAPACITY_CHANGED,
                pool.name,
                at=now,
                detail={"field": field, "from": before, "to": after},
                actor=actor,
            )
    transaction.on_commit(lambda: admission.admit([pool.name]))


def set_paused(name: str, paused: bool, *, actor: str | None = None) -> bool:
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
            events.record_pool(
                EventKind.CAPACITY_CHANGED, name, at=now, detail={"paused": paused}, actor=actor
            )
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
    actor: str | None = None,
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
        pool_saved(pool, old_slots=None, old_paused=None, actor=actor, created=True)
    return pool


def update_pool(name: str, *, actor: str | None = None, **changes: Any) -> Pool:
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
        old = {key: getattr(pool, key) for key in values}
        for key, value in values.items():
            setattr(pool, key, value)
        pool.save(update_fields=[*values, "updated_at"])
        pool_saved(pool, old_slots=old_slots, old_paused=old_paused, actor=actor, old=old)
    return pool


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


# --------------------------------------------------------------------------- per-key pools

_TEMPLATE_FIELDS = {"slots", "max_queued", "description"}


@dataclass(frozen=True, kw_only=True)
class PoolTemplate:
    """How to create a per-key pool named by ``pattern`` (``POOLS['TEMPLATES']``)."""

    pattern: str
    slots: int
    max_queued: int | None = None
    description: str = ""


def parse_template(pattern: str, raw: Any) -> PoolTemplate:
    """Validate one ``TEMPLATES`` item; raises ``PoolConfigurationError`` with the fix."""
    where = f"POOLS['TEMPLATES'][{pattern!r}]"
    validate_pool_pattern(pattern)
    if not isinstance(raw, dict):
        raise PoolConfigurationError(f"{where} must be a dict such as {{'slots': 1}}, got {raw!r}.")
    unknown = set(raw) - _TEMPLATE_FIELDS
    if unknown:
        hint = " (per-pool strategies are not available yet)" if "strategy" in unknown else ""
        raise PoolConfigurationError(
            f"{where} has unknown key(s) {sorted(unknown)}{hint}; "
            f"allowed: {sorted(_TEMPLATE_FIELDS)}."
        )
    if "slots" not in raw:
        raise PoolConfigurationError(f"{where} needs 'slots' (the capacity of each pool).")
    max_queued = raw.get("max_queued")
    return PoolTemplate(
        pattern=pattern,
        slots=validate_slots(raw["slots"], what=f"{where}['slots']"),
        max_queued=None
        if max_queued is None
        else validate_slots(max_queued, what=f"{where}['max_queued']"),
        description=str(raw.get("description", "")),
    )


def template_for(pattern: str) -> PoolTemplate:
    """The template of ``pattern``; ``PoolConfigurationError`` when settings have none."""
    raw = conf.get().TEMPLATES.get(pattern)
    if raw is None:
        raise PoolConfigurationError(
            f"@pooled names the per-key pool {pattern!r}, which has no template: add "
            f"POOLS['TEMPLATES'] = {{{pattern!r}: {{'slots': 1}}}} to settings."
        )
    return parse_template(pattern, raw)


def ensure_pool(name: str, pattern: str) -> Pool:
    """The per-key pool ``name``, created from the template of ``pattern`` on first use.

    Race-safe: concurrent first uses create one pool (the unique name decides; the loser
    reads the winner's row). An existing pool of that name is used as it is, whatever made
    it. The creation is logged as a ``pool_created`` event.
    """
    pool = Pool.objects.filter(name=name).first()
    if pool is not None:
        return pool
    template = template_for(pattern)
    for _attempt in range(3):
        try:
            with transaction.atomic():
                pool = Pool.objects.create(
                    name=name,
                    slots=template.slots,
                    max_queued=template.max_queued,
                    description=template.description,
                    template=pattern,
                )
                pool_saved(pool, old_slots=None, old_paused=None, created=True)
            return pool
        except IntegrityError:
            # Another first use won (or a retirement is deleting it: read again, retry).
            pool = Pool.objects.filter(name=name).first()
            if pool is not None:
                return pool
    raise PoolConfigurationError(f"Could not create the per-key pool {name!r}; try again.")


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
