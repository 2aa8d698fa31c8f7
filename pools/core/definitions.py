"""Pool definitions: ``POOLS["DEFINITIONS"]`` and its sync, the pool CRUD service functions,
and per-key pools made from ``POOLS["TEMPLATES"]`` on first use.

Every configuration change is logged in the event log (:mod:`pools.core.events`) with the
acting user (``actor``, a username) when the caller passes one: the admin and the REST API
do; settings sync, the sweep and code leave it empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from pools import conf
from pools.core import admission, events, locking, rates, strategies, windows
from pools.exceptions import (
    PoolConfigurationError,
    PoolDefinedInSettings,
    PoolInUse,
    UnknownPool,
)
from pools.models import (
    DELAYED,
    HELD_STATES,
    TERMINAL_STATES,
    Demand,
    EntryState,
    EventKind,
    OverflowPolicy,
    PausedPolicy,
    Pool,
    Strategy,
)
from pools.specs import refuse_reserved, validate_pool_name, validate_pool_pattern, validate_slots

#: Fields of a pool that settings, the admin and :func:`update_pool` may set (the name is
#: fixed: entries name it).
EDITABLE = (
    "slots",
    "max_queued",
    "paused",
    "description",
    "overflow",
    "paused_policy",
    "strategy",
    "aging_seconds",
    "spend_cap",
    "rate",
)
_FIELDS = set(EDITABLE)
#: Fields whose change gives the waiting entries new places (:func:`strategies.rerank`).
_ORDER_FIELDS = ("strategy", "aging_seconds")
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
    #: What a submit does when the backlog is at ``max_queued`` (:class:`OverflowPolicy`).
    overflow: str = OverflowPolicy.REJECT
    #: What a submit does while the pool is paused (:class:`PausedPolicy`).
    paused_policy: str = PausedPolicy.QUEUE
    #: The admission order (:class:`Strategy`).
    strategy: str = Strategy.PRIORITY
    #: Strategy ``priority``: one priority level gained per this many seconds waited.
    aging_seconds: int | None = None
    #: Slot-seconds the pool may spend per UTC day (:mod:`pools.core.spendcap`); None: no cap.
    spend_cap: float | None = None
    #: Rate limits on starts, stored form (``"10/s,100000/d"``; :mod:`pools.core.rates`).
    rate: str = ""


def parse(name: str, raw: Any) -> PoolDefinition:
    """Validate one ``DEFINITIONS`` item; raises ``PoolConfigurationError`` with the fix."""
    refuse_reserved(validate_pool_name(name))
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
    rate = rates.normalize(raw.get("rate"), what=f"POOLS['DEFINITIONS'][{name!r}]['rate']")
    if "slots" in raw:
        slots = validate_slots(raw["slots"], what=f"POOLS['DEFINITIONS'][{name!r}]['slots']")
    elif rate:  # a rate alone limits starts only
        slots = rates.UNLIMITED_SLOTS
    else:
        raise PoolConfigurationError(
            f"POOLS['DEFINITIONS'][{name!r}] needs 'slots' (or a 'rate' alone, such as "
            f"{{'rate': '100/m'}}, to limit starts only)."
        )
    max_queued = raw.get("max_queued")
    if max_queued is not None:
        max_queued = validate_slots(
            max_queued, what=f"POOLS['DEFINITIONS'][{name!r}]['max_queued']"
        )
    where = f"POOLS['DEFINITIONS'][{name!r}]"
    strategy = _choice(raw.get("strategy", Strategy.PRIORITY), Strategy, where, "strategy")
    aging = raw.get("aging_seconds")
    if aging is not None:
        aging = validate_slots(aging, what=f"{where}['aging_seconds']")
    check_order(strategy, aging, where=where)
    return PoolDefinition(
        name=name,
        slots=slots,
        max_queued=max_queued,
        paused=bool(raw.get("paused", False)),
        description=str(raw.get("description", "")),
        overflow=_choice(
            raw.get("overflow", OverflowPolicy.REJECT), OverflowPolicy, where, "overflow"
        ),
        paused_policy=_choice(
            raw.get("paused_policy", PausedPolicy.QUEUE), PausedPolicy, where, "paused_policy"
        ),
        strategy=strategy,
        aging_seconds=aging,
        spend_cap=_spend_cap(raw.get("spend_cap"), f"{where}['spend_cap']"),
        rate=rate,
    )


def check_order(strategy: str, aging_seconds: int | None, *, where: str = "") -> None:
    """Aging is a rule of strategy ``priority``: refuse it with another strategy."""
    if aging_seconds is not None and strategy != Strategy.PRIORITY:
        prefix = f"{where}: " if where else ""
        exc = PoolConfigurationError(
            f"{prefix}aging_seconds applies to strategy 'priority' only (it raises a waiting "
            f"entry's priority), not to {strategy!r}. Remove aging_seconds or use "
            f"strategy 'priority'."
        )
        exc.field = "aging_seconds"
        raise exc


def _spend_cap(value: Any, what: str) -> float | None:
    """A daily spend cap: a positive number of slot-seconds, or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise PoolConfigurationError(
            f"{what} must be a positive number of slot-seconds per UTC day (e.g. 3600 * 8 for "
            f"eight slot-hours) or None, got {value!r}."
        )
    return float(value)


def _choice(
    value: Any, choices: type[OverflowPolicy | PausedPolicy | Strategy], where: str, key: str
) -> str:
    """``value`` if it is one of ``choices``, else ``PoolConfigurationError`` listing them."""
    allowed = [str(c) for c in choices.values]
    if value not in allowed:
        exc = PoolConfigurationError(
            f"{where}[{key!r}] must be one of {allowed}, got {value!r}."
            if where
            else f"{key} must be one of {allowed}, got {value!r}."
        )
        exc.field = key
        raise exc
    return str(value)


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
    #: Pools whose capacity change waits for their queue to drain (``pending_slots``).
    draining: list[str] = field(default_factory=list)
    #: Pools removed from settings and deleted (they had no unfinished entry).
    deleted: list[str] = field(default_factory=list)
    #: Pools removed from settings that still hold or queue work: ``retiring``, deleted
    #: once empty (by the sweep), with how many unfinished entries they have.
    retiring: dict[str, int] = field(default_factory=dict)


def sync() -> SyncReport:
    """Create or update the pools declared in settings (pools made in the admin are kept).

    A changed ``slots`` goes through :func:`change_slots` (it drains while entries wait).
    A pool that was declared in settings and no longer is gets deleted when it has no
    unfinished entry, else marked ``retiring`` and deleted by the sweep once empty.
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
                    "max_queued": d.max_queued,
                    "paused": d.paused,
                    "description": d.description,
                    "overflow": d.overflow,
                    "paused_policy": d.paused_policy,
                    "strategy": d.strategy,
                    "aging_seconds": d.aging_seconds,
                    "spend_cap": d.spend_cap,
                    "rate": d.rate,
                    "defined_in_settings": True,
                },
            )
            if was_created:
                # Not logged: settings are the record of settings pools (their capacity
                # changes on sync are logged, below).
                created.append(d.name)
                continue
            wanted = {
                "max_queued": d.max_queued,
                "paused": d.paused,
                "description": d.description,
                "overflow": d.overflow,
                "paused_policy": d.paused_policy,
                "strategy": d.strategy,
                "aging_seconds": d.aging_seconds,
                "spend_cap": d.spend_cap,
                "rate": d.rate,
                "defined_in_settings": True,
                "retiring": False,
            }
            if configured_slots(pool) == d.slots and all(
                getattr(pool, k) == v for k, v in wanted.items()
            ):
                unchanged.append(d.name)
                continue
            with locking.locked_pools([d.name]) as locked:
                pool = locked[d.name]
                old_paused = pool.paused
                reorder = any(getattr(pool, k) != wanted[k] for k in _ORDER_FIELDS)
                if pool.rate != d.rate:
                    windows.reset(pool)  # new rates start from empty windows
                for key, value in wanted.items():
                    setattr(pool, key, value)
                pool.save(update_fields=[*wanted, "updated_at"])
                if reorder:
                    _reorder(pool, now)
                change_slots(pool, d.slots, now)
                _log_pause(pool, old_paused, now)
            updated.append(d.name)
            if pool.pending_slots is not None:
                draining.append(d.name)
    deleted, retiring = _retire_removed({d.name for d in declared_now}, now)
    if updated:
        admission.admit(updated)
    return SyncReport(
        created=created,
        updated=updated,
        unchanged=unchanged,
        draining=draining,
        deleted=deleted,
        retiring=retiring,
    )


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


def _log_pause(
    pool: Pool, old_paused: bool | None, now: datetime, actor: str | None = None
) -> None:
    """Log a change of ``paused`` as a capacity event."""
    if old_paused is not None and old_paused != pool.paused:
        events.record_pool(
            EventKind.CAPACITY_CHANGED,
            pool.name,
            at=now,
            detail={"paused": pool.paused},
            actor=actor,
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
) -> None:
    """After a pool was created or edited (admin, API): log the change and run admission.

    A capacity change is logged by :func:`change_slots` (``old_slots`` is kept for
    callers). ``old`` holds the edited fields' values before the change (``max_queued``,
    ``description``, policies): a change of one of them is logged too, as a ``capacity``
    event whose detail names the field. ``created`` logs a ``pool_created`` event with
    the pool's fields.
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
    _log_pause(pool, old_paused, now, actor)
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


def validate_fields(values: dict[str, Any]) -> dict[str, Any]:
    """Check pool fields with the same rules as settings; returns them normalized.

    Raises ``PoolConfigurationError`` naming the field (``exc.field``) and the fix.
    """
    out: dict[str, Any] = {}
    for key, value in values.items():
        try:
            if key == "name":
                out[key] = refuse_reserved(validate_pool_name(value))
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
            elif key == "overflow":
                out[key] = _choice(value, OverflowPolicy, "", key)
            elif key == "paused_policy":
                out[key] = _choice(value, PausedPolicy, "", key)
            elif key == "strategy":
                out[key] = _choice(value, Strategy, "", key)
            elif key == "aging_seconds":
                out[key] = None if value is None else validate_slots(value, what="aging_seconds")
            elif key == "spend_cap":
                out[key] = _spend_cap(value, "spend_cap")
            elif key == "rate":
                out[key] = rates.normalize(value, what="rate")
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
    overflow: str = OverflowPolicy.REJECT,
    paused_policy: str = PausedPolicy.QUEUE,
    strategy: str = Strategy.PRIORITY,
    aging_seconds: int | None = None,
    spend_cap: float | None = None,
    rate: Any = "",
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
            "overflow": overflow,
            "paused_policy": paused_policy,
            "strategy": strategy,
            "aging_seconds": aging_seconds,
            "spend_cap": spend_cap,
            "rate": rate,
        }
    )
    check_order(values["strategy"], values["aging_seconds"])
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
    """Change a pool's fields (:data:`EDITABLE`) under its lock.

    A new ``slots`` goes through :func:`change_slots` (it drains while entries wait).
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
        slots = values.pop("slots", None)
        reorder = any(k in values and getattr(pool, k) != values[k] for k in _ORDER_FIELDS)
        if "rate" in values and values["rate"] != pool.rate:
            windows.reset(pool)  # new rates start from empty windows
        for key, value in values.items():
            setattr(pool, key, value)
        check_order(pool.strategy, pool.aging_seconds)
        pool.save(update_fields=[*values, "updated_at"])
        if reorder:  # logged by pool_saved, with the actor (a "field" capacity event)
            strategies.rerank(pool)
        if slots is not None:
            change_slots(pool, slots, timezone.now(), actor=actor)
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

_TEMPLATE_FIELDS = {"slots", "max_queued", "description", "strategy", "aging_seconds", "rate"}


@dataclass(frozen=True, kw_only=True)
class PoolTemplate:
    """How to create a per-key pool named by ``pattern`` (``POOLS['TEMPLATES']``)."""

    pattern: str
    slots: int
    max_queued: int | None = None
    description: str = ""
    #: The admission order of each pool made from it, and its aging (strategy priority).
    strategy: str = Strategy.PRIORITY
    aging_seconds: int | None = None
    #: The rate of each pool made from it (stored form; each pool has its own windows).
    rate: str = ""


def parse_template(pattern: str, raw: Any) -> PoolTemplate:
    """Validate one ``TEMPLATES`` item; raises ``PoolConfigurationError`` with the fix."""
    where = f"POOLS['TEMPLATES'][{pattern!r}]"
    refuse_reserved(validate_pool_pattern(pattern))
    if not isinstance(raw, dict):
        raise PoolConfigurationError(f"{where} must be a dict such as {{'slots': 1}}, got {raw!r}.")
    unknown = set(raw) - _TEMPLATE_FIELDS
    if unknown:
        raise PoolConfigurationError(
            f"{where} has unknown key(s) {sorted(unknown)}; allowed: {sorted(_TEMPLATE_FIELDS)}."
        )
    rate = rates.normalize(raw.get("rate"), what=f"{where}['rate']")
    if "slots" not in raw and not rate:
        raise PoolConfigurationError(
            f"{where} needs 'slots' (the capacity of each pool), or a 'rate' alone such as "
            f"{{'rate': '10/s'}} to limit starts only."
        )
    max_queued = raw.get("max_queued")
    strategy = _choice(raw.get("strategy", Strategy.PRIORITY), Strategy, where, "strategy")
    aging = raw.get("aging_seconds")
    if aging is not None:
        aging = validate_slots(aging, what=f"{where}['aging_seconds']")
    check_order(strategy, aging, where=where)
    return PoolTemplate(
        pattern=pattern,
        strategy=strategy,
        aging_seconds=aging,
        slots=validate_slots(raw["slots"], what=f"{where}['slots']")
        if "slots" in raw
        else rates.UNLIMITED_SLOTS,
        max_queued=None
        if max_queued is None
        else validate_slots(max_queued, what=f"{where}['max_queued']"),
        description=str(raw.get("description", "")),
        rate=rate,
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
                    strategy=template.strategy,
                    aging_seconds=template.aging_seconds,
                    rate=template.rate,
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
