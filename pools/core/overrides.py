"""Per-key limit values: a per-key pool's own ``slots`` / ``rate`` / ``max_queued``.

A per-key pool takes its limits, field by field, from the first of:

1. an **override** set at runtime (REST API, admin): a :class:`~pools.models.PoolOverride`
   row kept by pool name, so it outlives the pool (the sweep retires an idle per-key pool;
   the next use creates it again with the override);
2. the template's **values callable** (``POOLS["TEMPLATES"][pattern]["values"]``, a dotted
   path), called with the key's fields (``limits_for(tenant_id="acme")``) and returning a
   dict of limit values; a bad return value is logged as an error naming the callable and
   the template's values apply;
3. the **template** itself.

A sync from settings (:func:`apply_templates`, run by ``settings_sync.sync``) gives the
existing per-key pools their template's (or callable's) values for the fields without an
override, and never touches an overridden field. Removing an override returns the field
to the value it would have without it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from django.utils import timezone

from pools import conf, pool_fields, rates_text
from pools.core import events, locking, pool_crud
from pools.core.capacity import configured_slots
from pools.core.declarations import PoolTemplate, template_for, values_callable
from pools.exceptions import PoolConfigurationError
from pools.models import EventKind, Pool, PoolOverride
from pools.pool_names import key_fields

log = logging.getLogger("pools.overrides")

LIMIT_FIELDS = pool_fields.LIMIT_FIELDS
#: Where a value comes from (:attr:`Limits.sources`).
OVERRIDE, PLAN, TEMPLATE = "override", "values", "template"


@dataclass(frozen=True, kw_only=True)
class Limits:
    """The limit values of one per-key pool, by where they come from."""

    pattern: str
    #: The template's own values (settings).
    template: dict[str, Any]
    #: The values callable's answer, checked (empty without a callable or on error).
    plan: dict[str, Any] = field(default_factory=dict)
    #: Overrides set at runtime.
    override: dict[str, Any] = field(default_factory=dict)
    #: Why the callable's answer was not used ("" when it was, or when there is none).
    plan_error: str = ""

    @property
    def values(self) -> dict[str, Any]:
        """The values in effect: override, else the callable's, else the template's."""
        return {**self.template, **self.plan, **self.override}

    @property
    def base(self) -> dict[str, Any]:
        """The values without the overrides (what removing them returns to)."""
        return {**self.template, **self.plan}

    def source(self, name: str) -> str:
        """``override``, ``values`` (the callable) or ``template``."""
        if name in self.override:
            return OVERRIDE
        return PLAN if name in self.plan else TEMPLATE


# --------------------------------------------------------------------------- reading


def pattern_of(name: str) -> str | None:
    """The ``POOLS["TEMPLATES"]`` pattern pool ``name`` is made from, or None.

    An existing pool says it (``Pool.template``); a name not yet used is matched against
    the patterns (the first by sorted pattern wins).
    """
    templates = conf.get().TEMPLATES
    stored = Pool.objects.filter(name=name).values_list("template", flat=True).first()
    if stored is not None:
        return stored if stored in templates else None
    for pattern in sorted(templates):
        if key_fields(pattern, name) is not None:
            return pattern
    return None


def check_values(raw: Any, *, where: str) -> dict[str, Any]:
    """A dict of limit values checked with the pool field table (stored form).

    ``None`` is no value. Raises ``PoolConfigurationError`` naming ``where`` (the field
    alone when empty, as the REST API and the admin say it).
    """
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise PoolConfigurationError(
            f"{where or 'overrides'} must return a dict of {list(LIMIT_FIELDS)} such as {{'slots': 8}} "
            f"(or None), got {raw!r}."
        )
    unknown = sorted(str(k) for k in raw if k not in LIMIT_FIELDS)
    if unknown:
        prefix = f"{where}: unknown" if where else "Unknown"
        exc = PoolConfigurationError(
            f"{prefix} limit(s) {unknown}; a per-key pool may carry its own "
            f"{list(LIMIT_FIELDS)} only."
        )
        exc.field = unknown[0]
        raise exc
    return {
        name: pool_fields.FIELDS[name].clean(raw[name], f"{where}[{name!r}]" if where else name)
        for name in LIMIT_FIELDS
        if name in raw
    }


def _template_values(template: PoolTemplate) -> dict[str, Any]:
    return {name: getattr(template, name) for name in LIMIT_FIELDS}


def plan_values(template: PoolTemplate, name: str) -> tuple[dict[str, Any], str]:
    """The template's values callable for pool ``name``: ``(values, error)``.

    On any failure (import, exception, bad return value) the error is logged, names the
    callable, and the values are empty: the template's apply.
    """
    if not template.values:
        return {}, ""
    where = f"POOLS['TEMPLATES'][{template.pattern!r}]['values'] ({template.values})"
    fields = key_fields(template.pattern, name) or {}
    try:
        func = values_callable(template)
    except PoolConfigurationError as exc:
        error = f"{exc} The template's values apply to {name!r}."
        log.error(error)
        return {}, error
    assert func is not None  # template.values is set
    try:
        raw = func(**fields)
    except Exception as exc:  # the user's callable: report, fall back
        error = (
            f"{where} raised {type(exc).__name__}: {exc} for {fields}. The template's values "
            f"apply to {name!r}."
        )
        log.error(error, exc_info=True)
        return {}, error
    try:
        return check_values(raw, where=f"{where} for {fields}"), ""
    except PoolConfigurationError as exc:
        error = f"{exc} The template's values apply to {name!r}."
        log.error(error)
        return {}, error


def limits_for(
    name: str, pattern: str, *, override: Mapping[str, Any] | None = None, plan: bool = True
) -> Limits:
    """The limits of per-key pool ``name`` of ``pattern`` (``override``: the stored row's
    values when the caller has read them; ``plan``: call the values callable)."""
    template = template_for(pattern)
    if override is None:
        row = PoolOverride.objects.filter(pool=name).values_list("values", flat=True).first()
        override = row or {}
    planned, error = plan_values(template, name) if plan else ({}, "")
    return Limits(
        pattern=pattern,
        template=_template_values(template),
        plan=planned,
        override={k: v for k, v in override.items() if k in LIMIT_FIELDS},
        plan_error=error,
    )


def describe(name: str) -> dict[str, Any] | None:
    """The limits of per-key pool ``name`` (created or not yet) with the source of each,
    as ``GET pools/<name>/overrides`` answers them; None when no template makes ``name``.
    Calls the values callable."""
    pattern = pattern_of(name)
    if pattern is None:
        return None
    limits = limits_for(name, pattern)
    values, base = limits.values, limits.base
    return {
        "pool": name,
        "template": pattern,
        "exists": Pool.objects.filter(name=name).exists(),
        "overrides": limits.override,
        "limits": {
            key: {
                "value": values[key],
                "source": limits.source(key),
                "template": limits.template[key],
                "without_override": base[key],
            }
            for key in LIMIT_FIELDS
        },
        "values_error": limits.plan_error,
    }


def stored(names: list[str]) -> dict[str, dict[str, Any]]:
    """The override rows of ``names``: ``{pool name: values}`` (one query)."""
    return dict(PoolOverride.objects.filter(pool__in=names).values_list("pool", "values"))


# --------------------------------------------------------------------------- display


def shown(name: str, value: Any) -> str:
    """A limit value for people: ``8``, ``unlimited``, ``20/s, 100/m``, ``none``."""
    if name == "slots":
        return "unlimited" if value >= rates_text.UNLIMITED_SLOTS else str(value)
    if name == "max_queued":
        return "unlimited" if value is None else str(value)
    return ", ".join(part for part in str(value or "").split(",") if part) or "none"


def detail(pattern: str, override: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The overridden limits of a pool of ``pattern``: ``{field: {"value": v, "template":
    t}}`` with the template's value from settings (no callable is called); empty for a
    pool without overrides or whose pattern is no longer in ``POOLS["TEMPLATES"]``."""
    if not override or pattern not in conf.get().TEMPLATES:
        return {}
    try:
        template = _template_values(template_for(pattern))
    except PoolConfigurationError:
        return {}
    return {
        name: {"value": override[name], "template": template[name]}
        for name in LIMIT_FIELDS
        if name in override
    }


def labels(details: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """``["slots 8 (override; template 2)", ...]`` from :func:`detail`."""
    return [
        f"{name} {shown(name, d['value'])} (override; template {shown(name, d['template'])})"
        for name, d in details.items()
    ]


# --------------------------------------------------------------------------- changes


def set_overrides(name: str, values: Mapping[str, Any], *, actor: str | None = None) -> dict:
    """Override limit values of per-key pool ``name`` (created or not yet), merged with
    its other overrides; applied at once to an existing pool (a new ``slots`` drains as
    every capacity change does). Logged with ``actor``. Returns the pool's overrides.

    Raises ``PoolConfigurationError`` (a bad value, a field other than the limits, a name
    no template makes) or ``PoolUnavailable``.
    """
    pattern = _pattern_or_error(name)
    checked = check_values(values, where="")
    if not checked:
        raise PoolConfigurationError(
            f"Give at least one of {list(LIMIT_FIELDS)} to override, e.g. {{'slots': 8}}."
        )
    if Pool.objects.filter(name=name).exists():
        pool_crud.update_pool(name, actor=actor, **checked)  # records the override
    else:
        pool_crud.save_override(name, pattern, checked, actor=actor)
        _apply_if_created_meanwhile(name, pattern)
    return current(name)


def clear_overrides(
    name: str, fields: list[str] | None = None, *, actor: str | None = None
) -> dict[str, Any]:
    """Remove overrides of pool ``name`` (``fields``, or all): each field returns to the
    value it would have without it (the callable's, else the template's). Logged with
    ``actor``. Returns the overrides left. The row of a name no template makes any more
    (its pattern left settings) is removed as well; there is no pool to change then."""
    pattern = pattern_of(name)
    if pattern is None and not PoolOverride.objects.filter(pool=name).exists():
        pattern = _pattern_or_error(name)
    fields = list(LIMIT_FIELDS if fields is None else fields)
    unknown = [f for f in fields if f not in LIMIT_FIELDS]
    if unknown:
        exc = PoolConfigurationError(
            f"Unknown limit(s) {unknown}; a per-key pool's overrides are {list(LIMIT_FIELDS)}."
        )
        exc.field = "fields"
        raise exc
    with locking.locked_override(name) as row:
        removed = [f for f in fields if row is not None and f in row.values]
        if row is None or not removed:
            return dict(row.values) if row is not None else {}
        left = {k: v for k, v in row.values.items() if k not in removed}
        if left:
            row.values, row.actor = left, actor or ""
            row.save(update_fields=["values", "actor", "updated_at"])
        else:
            row.delete()
        events.record_pool(
            EventKind.CAPACITY_CHANGED,
            name,
            at=timezone.now(),
            detail={"override_removed": removed, "template": pattern or row.template},
            actor=actor,
        )
    if pattern is not None:
        _apply(name, pattern, only=removed, actor=actor)
    return left


def current(name: str) -> dict[str, Any]:
    """The overrides of pool ``name`` ({} when none)."""
    row = PoolOverride.objects.filter(pool=name).values_list("values", flat=True).first()
    return dict(row or {})


def _pattern_or_error(name: str) -> str:
    pattern = pattern_of(name)
    if pattern is None:
        exc = PoolConfigurationError(
            f"{name!r} is not a per-key pool of POOLS['TEMPLATES'] (no template's pattern "
            f"makes this name): change a plain pool's limits on the pool itself."
        )
        exc.field = "name"
        raise exc
    return pattern


def _differences(pool: Pool, wanted: Mapping[str, Any]) -> dict[str, Any]:
    have = {"slots": configured_slots(pool), "rate": pool.rate, "max_queued": pool.max_queued}
    return {k: v for k, v in wanted.items() if have[k] != v}


def _apply(
    name: str, pattern: str, *, only: list[str] | None = None, actor: str | None = None
) -> bool:
    """Give existing pool ``name`` its limits (all, or the fields ``only``); False when the
    pool does not exist or already has them."""
    pool = Pool.objects.filter(name=name).first()
    if pool is None:
        return False
    wanted = limits_for(name, pattern).values
    if only is not None:
        wanted = {k: v for k, v in wanted.items() if k in only}
    changes = _differences(pool, wanted)
    if changes:
        pool_crud.update_pool(name, actor=actor, as_override=False, **changes)
    return bool(changes)


def _apply_if_created_meanwhile(name: str, pattern: str) -> None:
    """An override saved for a pool not yet created: a first use that read the overrides
    before this commit and created the pool after must get them now."""
    if Pool.objects.filter(name=name).exists():
        _apply(name, pattern)


def creation_detail(limits: Limits) -> dict[str, Any]:
    """What a ``pool_created`` event of a per-key pool adds: the values not from the
    template, by source, and the values callable's error if any."""
    detail: dict[str, Any] = {}
    if limits.override:
        detail["override"] = dict(limits.override)
    plan = {k: v for k, v in limits.plan.items() if k not in limits.override}
    if plan:
        detail["values"] = plan
    if limits.plan_error:
        detail["values_error"] = limits.plan_error
    return detail


def applied_after_create(pool: Pool, applied: Mapping[str, Any]) -> None:
    """After :func:`pools.core.per_key.ensure_pool` created ``pool`` with ``applied``
    overrides: one saved meanwhile (read after the creation committed) is applied now."""
    now = current(pool.name)
    if now != dict(applied):
        _apply(pool.name, pool.template)


def apply_templates() -> list[str]:
    """Sync: give every existing per-key pool its template's (or callable's) values for
    the fields without an override; returns the names of the pools changed."""
    templates = conf.get().TEMPLATES
    pools = list(Pool.objects.filter(template__in=list(templates)).order_by("name"))
    rows = stored([p.name for p in pools])
    changed = []
    for pool in pools:
        wanted = limits_for(pool.name, pool.template, override=rows.get(pool.name, {})).values
        changes = _differences(pool, wanted)
        if changes:
            pool_crud.update_pool(pool.name, as_override=False, **changes)
            changed.append(pool.name)
    return changed
