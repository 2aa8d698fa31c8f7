"""The fields of a pool in one table: type, default, bounds and the surfaces that take each.

Settings (``POOLS["DEFINITIONS"]``, ``POOLS["DEFAULT_POOL"]``, ``POOLS["TEMPLATES"]``), the
pool services (:mod:`pools.core.pool_crud`), the REST body and the admin form all check a
pool field here, with one message per rule. A new pool option is a row of :data:`FIELDS`
(with its model field, a migration and, for the REST body, a serializer field).

Pure Python: no database (importable by :mod:`pools.models`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from django.db.models import TextChoices
from django.utils.translation import gettext_lazy as _

from pools import rates_text
from pools.exceptions import PoolConfigurationError
from pools.pool_names import refuse_reserved, validate_pool_name
from pools.specs import positive_int

# --------------------------------------------------------------------------- choices


class OverflowPolicy(TextChoices):
    """What a submit to a pool whose backlog is at ``max_queued`` does."""

    REJECT = "reject", _("reject the new entry")
    DROP_OLDEST = "drop_oldest", _("drop the oldest waiting entry")
    DROP_NEWEST = "drop_newest", _("drop the newest waiting entry")


class PausedPolicy(TextChoices):
    """What a submit to a paused pool does."""

    QUEUE = "queue", _("queue it")
    REJECT = "reject", _("reject it")


class Strategy(TextChoices):
    """The order in which a pool admits its waiting entries (docs/concepts/fairness.md)."""

    PRIORITY = "priority", _("priority, then first come first served")
    FIFO = "fifo", _("first come first served")
    LIFO = "lifo", _("last come first served")
    FAIR = "fair", _("round robin across fairness keys")


# --------------------------------------------------------------------------- surfaces

#: ``POOLS["DEFINITIONS"][name]``.
SETTINGS = "settings"
#: ``POOLS["DEFAULT_POOL"]``.
DEFAULT_POOL = "default_pool"
#: ``POOLS["TEMPLATES"][pattern]`` (per-key pools).
TEMPLATE = "template"
#: The pool services ``create_pool`` / ``update_pool``: the REST API and the admin form.
CRUD = "crud"
SURFACES = (SETTINGS, DEFAULT_POOL, TEMPLATE, CRUD)

#: Where each settings surface is, and an example of a valid value, for the messages.
_EXAMPLES = {
    SETTINGS: "{'slots': 4}",
    DEFAULT_POOL: "{'name': 'default', 'slots': 128}",
    TEMPLATE: "{'slots': 1}",
}

# --------------------------------------------------------------------------- checks

#: A field's check: ``(value, what)`` to the value as stored; ``what`` names the field in
#: the message (``"slots"``, ``"POOLS['DEFINITIONS']['x']['slots']"``).
Check = Callable[[Any, str], Any]


def _name(value: Any, what: str) -> str:
    return refuse_reserved(validate_pool_name(value))


def _positive(value: Any, what: str) -> int:
    return positive_int(value, what=what)


def _optional_positive(value: Any, what: str) -> int | None:
    return None if value is None else positive_int(value, what=what)


def _bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise PoolConfigurationError(f"{what} must be true or false, got {value!r}.")
    return value


def _truth(value: Any, what: str) -> bool:
    return bool(value)


def _text(value: Any, what: str) -> str:
    return str(value)


def _choice(choices: type[TextChoices]) -> Check:
    allowed = [str(c) for c in choices.values]

    def check(value: Any, what: str) -> str:
        if value not in allowed:
            raise PoolConfigurationError(f"{what} must be one of {allowed}, got {value!r}.")
        return str(value)

    return check


def _spend_cap(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise PoolConfigurationError(
            f"{what} must be a positive number of slot-seconds per UTC day (e.g. 3600 * 8 for "
            f"eight slot-hours) or None, got {value!r}."
        )
    return float(value)


def _rate(value: Any, what: str) -> str:
    return rates_text.normalize(value, what=what)


def _queues(value: Any, what: str) -> frozenset[str]:
    if (
        isinstance(value, str)
        or not isinstance(value, list | tuple | set | frozenset)
        or not value
        or not all(isinstance(q, str) and q for q in value)
    ):
        raise PoolConfigurationError(
            f"{what} must be a non-empty list of queue names such as ['celery'], got {value!r}."
        )
    return frozenset(value)


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True, kw_only=True)
class PoolField:
    """One field of a pool: how it is checked and where it may be given."""

    name: str
    #: What a valid value is, in words (the docs and the tests use it).
    kind: str
    #: The value when the field is left out (``slots``: none, it is required; see
    #: :func:`slots_of`).
    default: Any
    #: The surfaces that accept it (:data:`SURFACES`).
    surfaces: frozenset[str]
    check: Check
    #: For a choice field, the allowed values.
    choices: tuple[str, ...] = ()
    #: How the settings surfaces read it, when more leniently than :attr:`check` (settings
    #: have always taken any value of ``paused`` as a truth value).
    settings_check: Check | None = None

    def clean(self, value: Any, what: str, surface: str = CRUD) -> Any:
        """``value`` checked as ``surface`` takes it; the error names the field."""
        check = self.check
        if surface != CRUD and self.settings_check is not None:
            check = self.settings_check
        try:
            return check(value, what)
        except PoolConfigurationError as exc:
            exc.field = self.name
            raise


_ALL_SETTINGS = frozenset({SETTINGS, TEMPLATE, CRUD})
_NOT_TEMPLATE = frozenset({SETTINGS, CRUD})

#: Every pool field, in the order they are checked and listed.
FIELDS: dict[str, PoolField] = {
    f.name: f
    for f in (
        PoolField(
            name="name",
            kind="1-100 letters, digits and '_ . : -', not a workflow cap's prefix",
            # The default pool's name; the services need one.
            default="default",
            surfaces=frozenset({DEFAULT_POOL, CRUD}),
            check=_name,
        ),
        PoolField(
            name="slots",
            kind="positive integer (unlimited with a rate alone)",
            default=None,
            surfaces=frozenset(SURFACES),
            check=_positive,
        ),
        PoolField(
            name="max_queued",
            kind="positive integer or None (unlimited)",
            default=None,
            surfaces=frozenset(SURFACES),
            check=_optional_positive,
        ),
        PoolField(
            name="paused",
            kind="true or false",
            default=False,
            surfaces=_NOT_TEMPLATE,
            check=_bool,
            settings_check=_truth,
        ),
        PoolField(
            name="description",
            kind="text",
            default="",
            surfaces=_ALL_SETTINGS,
            check=_text,
        ),
        PoolField(
            name="overflow",
            kind="choice",
            default=OverflowPolicy.REJECT,
            surfaces=_NOT_TEMPLATE,
            check=_choice(OverflowPolicy),
            choices=tuple(OverflowPolicy.values),
        ),
        PoolField(
            name="paused_policy",
            kind="choice",
            default=PausedPolicy.QUEUE,
            surfaces=_NOT_TEMPLATE,
            check=_choice(PausedPolicy),
            choices=tuple(PausedPolicy.values),
        ),
        PoolField(
            name="strategy",
            kind="choice",
            default=Strategy.PRIORITY,
            surfaces=_ALL_SETTINGS,
            check=_choice(Strategy),
            choices=tuple(Strategy.values),
        ),
        PoolField(
            name="aging_seconds",
            kind="positive integer or None (no aging); strategy 'priority' only",
            default=None,
            surfaces=_ALL_SETTINGS,
            check=_optional_positive,
        ),
        PoolField(
            name="spend_cap",
            kind="positive number of slot-seconds per UTC day, or None (no cap)",
            default=None,
            surfaces=_NOT_TEMPLATE,
            check=_spend_cap,
        ),
        PoolField(
            name="rate",
            kind="rates such as '10/s,100000/d' (N/s, N/m, N/h, N/d), a list, or None",
            default="",
            surfaces=_ALL_SETTINGS,
            check=_rate,
        ),
        PoolField(
            name="queues",
            kind="non-empty list of queue names",
            default=frozenset({"celery"}),
            surfaces=frozenset({DEFAULT_POOL}),
            check=_queues,
        ),
    )
}


def names(surface: str) -> tuple[str, ...]:
    """The fields ``surface`` accepts, in table order."""
    return tuple(name for name, f in FIELDS.items() if surface in f.surfaces)


#: Fields of a pool that settings, the admin and ``update_pool`` may set (the name is
#: fixed: entries name it).
EDITABLE = tuple(name for name in names(CRUD) if name != "name")
#: The limit values a per-key pool may carry of its own (:mod:`pools.core.overrides`).
LIMIT_FIELDS = ("slots", "rate", "max_queued")
#: Fields whose change gives the waiting entries new places (``strategies.rerank``).
ORDER_FIELDS = ("strategy", "aging_seconds")


def check(name: str, value: Any) -> Any:
    """One field of the pool services (REST, admin) checked; the error names the field."""
    field = FIELDS.get(name)
    if field is None or CRUD not in field.surfaces:
        exc = PoolConfigurationError(
            f"Unknown pool field {name!r}; allowed: name, {', '.join(EDITABLE)}."
        )
        exc.field = name
        raise exc
    return field.clean(value, name)


def check_fields(values: Mapping[str, Any]) -> dict[str, Any]:
    """The pool services' fields checked in the order given; returns them normalized."""
    return {name: check(name, value) for name, value in values.items()}


def read(surface: str, where: str, raw: Any) -> dict[str, Any]:
    """A settings item (``surface``, at ``where``) checked: every field it accepts, with the
    defaults of those left out, except ``slots`` when absent (see :func:`slots_of`)."""
    if not isinstance(raw, dict):
        raise PoolConfigurationError(
            f"{where} must be a dict such as {_EXAMPLES[surface]}, got {raw!r}."
        )
    allowed = names(surface)
    unknown = set(raw) - set(allowed)
    if unknown:
        raise PoolConfigurationError(
            f"{where} has unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}."
        )
    values: dict[str, Any] = {}
    for name in allowed:
        field = FIELDS[name]
        if name in raw:
            values[name] = field.clean(raw[name], f"{where}[{name!r}]", surface)
        elif name != "slots":
            values[name] = field.default
    return values


def slots_of(values: Mapping[str, Any], where: str, needs: str) -> int:
    """The capacity: ``values["slots"]``, else unlimited when a rate alone limits starts;
    with neither, ``PoolConfigurationError`` saying what ``where`` ``needs``."""
    if "slots" in values:
        slots: int = values["slots"]
        return slots
    if values.get("rate"):
        return rates_text.UNLIMITED_SLOTS
    raise PoolConfigurationError(f"{where} needs {needs}")


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
