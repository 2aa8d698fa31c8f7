"""Pool names: what a name may be, per-key name patterns (``"tenant:{tenant_id}"``) and the
names of the pools workflow caps make (``run-cap:``, ``task-cap:``) with their gate order.

Pure Python: no database, no Celery. Raises
:class:`~pools.exceptions.PoolConfigurationError` (or
:class:`~pools.exceptions.PoolKeyError` for a call whose arguments name no valid pool).
"""

from __future__ import annotations

import hashlib
import re
import string
from collections.abc import Mapping
from typing import Any

from pools.exceptions import PoolConfigurationError, PoolKeyError

#: A pool name: starts with a letter or digit; letters, digits, ``_ . : -``; at most 100.
POOL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:\-]{0,99}$")

#: Prefixes of the pools the gates make by themselves (workflow caps): a run cap
#: (``pools.limit_run``) is pool ``run-cap:<root id>``, a task cap (``max_running``) is
#: pool ``task-cap:<task name>``. Admission checks them first, in this order.
RUN_CAP_PREFIX = "run-cap:"
TASK_CAP_PREFIX = "task-cap:"
CAP_PREFIXES = (RUN_CAP_PREFIX, TASK_CAP_PREFIX)
#: :func:`gate_rank` of a named pool (after every cap).
NAMED_RANK = len(CAP_PREFIXES)


def cap_pool_name(prefix: str, key: str) -> str:
    """The pool of a run cap or a task cap: ``prefix`` + ``key``, made a valid pool name.

    A key with characters a pool name does not allow, or too long, is shortened and made
    unique with a hash of it.
    """
    name = prefix + key
    if POOL_NAME_RE.match(name):
        return name
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    safe = re.sub(r"[^A-Za-z0-9_.:\-]", "_", key)[: 100 - len(prefix) - 13]
    return f"{prefix}{safe}-{digest}"


def gate_rank(pool: str) -> int:
    """Order of the gates over an entry's pools: run cap, task cap, then named pools."""
    for rank, prefix in enumerate(CAP_PREFIXES):
        if pool.startswith(prefix):
            return rank
    return NAMED_RANK


def refuse_reserved(name: str, *, what: str = "Pool name") -> str:
    """Refuse a user-chosen pool name that takes a workflow cap's prefix."""
    for prefix in CAP_PREFIXES:
        if name.startswith(prefix):
            raise PoolConfigurationError(
                f"{what} {name!r} starts with {prefix!r}, which is reserved for workflow caps "
                f"(pools.limit_run, @pooled(max_running=...)); choose another name."
            )
    return name


def validate_pool_name(name: object) -> str:
    """Return ``name`` if it is a valid pool name, else raise ``PoolConfigurationError``."""
    if not isinstance(name, str) or not POOL_NAME_RE.match(name):
        raise PoolConfigurationError(
            f"Invalid pool name {name!r}: use 1-100 characters, letters, digits and '_ . : -', "
            f"starting with a letter or digit (e.g. 'warehouse' or 'partner-api')."
        )
    return name


def is_pattern(name: str) -> bool:
    """True for a per-key pool name pattern such as ``"tenant:{tenant_id}"``."""
    return "{" in name or "}" in name


def pattern_fields(pattern: str) -> list[str]:
    """The argument names a pattern is formatted from, in order; raises if it is malformed."""
    try:
        parsed = list(string.Formatter().parse(pattern))
    except ValueError as exc:
        raise PoolConfigurationError(
            f"Invalid pool name pattern {pattern!r}: {exc}. Write it as 'tenant:{{tenant_id}}'."
        ) from None
    names = []
    for _literal, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            raise PoolConfigurationError(
                f"Invalid pool name pattern {pattern!r}: each {{...}} must be a plain argument "
                f"name such as {{tenant_id}} (no index, attribute, conversion or format spec)."
            )
        names.append(name)
    return names


def validate_pool_pattern(pattern: object) -> str:
    """Return ``pattern`` if it is a valid per-key pool name pattern, else raise."""
    if not isinstance(pattern, str) or not is_pattern(pattern):
        raise PoolConfigurationError(
            f"Invalid pool name pattern {pattern!r}: it needs at least one {{argument}}, "
            f"e.g. 'tenant:{{tenant_id}}'."
        )
    names = pattern_fields(pattern)
    if not names:
        raise PoolConfigurationError(
            f"Invalid pool name pattern {pattern!r}: it needs at least one {{argument}}, "
            f"e.g. 'tenant:{{tenant_id}}'."
        )
    sample = pattern.format(**{n: "x" for n in names})
    if not POOL_NAME_RE.match(sample):
        raise PoolConfigurationError(
            f"Invalid pool name pattern {pattern!r}: once formatted it must be a valid pool "
            f"name (letters, digits and '_ . : -', starting with a letter or digit)."
        )
    return pattern


def key_fields(pattern: str, name: str) -> dict[str, str] | None:
    """The key's fields read back from a pool name ``pattern`` formatted to, or None when
    ``name`` is not of that pattern (``key_fields("tenant:{tenant_id}", "tenant:acme")``
    is ``{"tenant_id": "acme"}``). With several fields, the earlier ones take the shortest
    match."""
    regex = ""
    for literal, field_name, _spec, _conversion in string.Formatter().parse(pattern):
        regex += re.escape(literal)
        if field_name is not None:
            regex += f"(?P<{field_name}>.+?)"
    try:
        match = re.fullmatch(regex, name)
    except re.error:  # a field named twice: not a pattern a template can have
        return None
    return None if match is None else dict(match.groupdict())


def validate_pool_name_or_pattern(name: object) -> str:
    """A pool name, or a per-key pattern (``"tenant:{tenant_id}"``), checked."""
    if isinstance(name, str) and is_pattern(name):
        return validate_pool_pattern(name)
    return validate_pool_name(name)


def format_pool_name(pattern: str, values: Mapping[str, Any], *, task: str = "") -> str:
    """The pool name ``pattern`` gives for a call's argument ``values``.

    Raises :class:`~pools.exceptions.PoolKeyError` for a missing argument or a value that
    does not make a valid pool name.
    """
    what = f"task {task!r}" if task else "the task"
    missing = [n for n in pattern_fields(pattern) if n not in values]
    if missing:
        raise PoolKeyError(
            f"Pool {pattern!r} of {what} is named from argument(s) {', '.join(missing)}, "
            f"which the call does not pass. Pass {missing[0]}=... (by name or position)."
        )
    name = pattern.format(**{n: values[n] for n in pattern_fields(pattern)})
    if not POOL_NAME_RE.match(name):
        raise PoolKeyError(
            f"Pool {pattern!r} of {what} formats to {name!r}, which is not a valid pool name "
            f"(1-100 letters, digits and '_ . : -', starting with a letter or digit). Pass "
            f"another value or change the pattern."
        )
    return name
