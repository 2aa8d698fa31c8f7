"""The pools settings declare: ``POOLS["DEFINITIONS"]``, ``POOLS["DEFAULT_POOL"]`` and the
per-key templates of ``POOLS["TEMPLATES"]``, read and checked with the pool field table
(:mod:`pools.pool_fields`). No database.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from django.utils.module_loading import import_string

from pools import conf, pool_fields
from pools.exceptions import PoolConfigurationError
from pools.pool_fields import (
    DEFAULT_POOL,
    SETTINGS,
    TEMPLATE,
    OverflowPolicy,
    PausedPolicy,
    Strategy,
)
from pools.pool_names import refuse_reserved, validate_pool_name, validate_pool_pattern


@dataclass(frozen=True, kw_only=True)
class PoolDefinition:
    """One pool as declared in settings (defaults: :data:`pools.pool_fields.FIELDS`)."""

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
    where = f"POOLS['DEFINITIONS'][{name!r}]"
    values = pool_fields.read(SETTINGS, where, raw)
    values["slots"] = pool_fields.slots_of(
        values,
        where,
        "'slots' (or a 'rate' alone, such as {'rate': '100/m'}, to limit starts only).",
    )
    pool_fields.check_order(values["strategy"], values["aging_seconds"], where=where)
    return PoolDefinition(name=name, **values)


@dataclass(frozen=True, kw_only=True)
class DefaultPool:
    """The implicit default pool (``POOLS['DEFAULT_POOL']``)."""

    name: str
    slots: int
    #: Tasks without ``@pooled`` routed to one of these queues are admitted through the pool.
    queues: frozenset[str]
    max_queued: int | None = None


def parse_default_pool(raw: Any) -> DefaultPool:
    """Validate ``POOLS['DEFAULT_POOL']``; raises ``PoolConfigurationError`` with the fix."""
    where = "POOLS['DEFAULT_POOL']"
    values = pool_fields.read(DEFAULT_POOL, where, raw)
    if "slots" not in values:  # no rate here: the default pool always has a capacity
        raise PoolConfigurationError(f"{where} needs 'slots' (the capacity of the pool).")
    return DefaultPool(**values)


def default_pool() -> DefaultPool | None:
    """The implicit default pool in effect, or None when it is off."""
    raw = conf.get().DEFAULT_POOL
    return None if raw is None else parse_default_pool(raw)


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
    #: ``"values"``: dotted path of a callable mapping a key's fields to limit values
    #: (:mod:`pools.core.overrides`); empty when the template has none.
    values: str = ""


def parse_template(pattern: str, raw: Any) -> PoolTemplate:
    """Validate one ``TEMPLATES`` item; raises ``PoolConfigurationError`` with the fix."""
    where = f"POOLS['TEMPLATES'][{pattern!r}]"
    refuse_reserved(validate_pool_pattern(pattern))
    plan = ""
    if isinstance(raw, dict) and "values" in raw:
        raw = dict(raw)
        plan = _values_path(raw.pop("values"), where)
    values = pool_fields.read(TEMPLATE, where, raw)
    values["slots"] = pool_fields.slots_of(
        values,
        where,
        "'slots' (the capacity of each pool), or a 'rate' alone such as {'rate': '10/s'} "
        "to limit starts only.",
    )
    pool_fields.check_order(values["strategy"], values["aging_seconds"], where=where)
    return PoolTemplate(pattern=pattern, values=plan, **values)


def _values_path(raw: Any, where: str) -> str:
    """A template's ``values``: the dotted path of a callable (``"myapp.plans.limits_for"``)."""
    if not isinstance(raw, str) or "." not in raw.strip(".") or any(c.isspace() for c in raw):
        raise PoolConfigurationError(
            f"{where}['values'] must be the dotted path of a callable such as "
            f"'myapp.plans.limits_for' (taking the key's fields, returning a dict of "
            f"{list(pool_fields.LIMIT_FIELDS)}), got {raw!r}."
        )
    return raw


def template_for(pattern: str) -> PoolTemplate:
    """The template of ``pattern``; ``PoolConfigurationError`` when settings have none."""
    raw = conf.get().TEMPLATES.get(pattern)
    if raw is None:
        raise PoolConfigurationError(
            f"@pooled names the per-key pool {pattern!r}, which has no template: add "
            f"POOLS['TEMPLATES'] = {{{pattern!r}: {{'slots': 1}}}} to settings."
        )
    return parse_template(pattern, raw)


def values_callable(template: PoolTemplate) -> Callable[..., Any] | None:
    """The template's ``values`` callable imported (None without one); an import failure
    or a non-callable raises ``PoolConfigurationError`` naming it."""
    if not template.values:
        return None
    where = f"POOLS['TEMPLATES'][{template.pattern!r}]['values']"
    try:
        func = import_string(template.values)
    except ImportError as exc:
        raise PoolConfigurationError(
            f"{where}: {template.values!r} cannot be imported ({exc}); give the dotted path "
            f"of a function such as 'myapp.plans.limits_for'."
        ) from None
    if not callable(func):
        raise PoolConfigurationError(f"{where}: {template.values!r} is not callable.")
    return cast("Callable[..., Any]", func)
