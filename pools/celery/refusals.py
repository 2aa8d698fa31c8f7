"""Refusals of the gate: a bad call becomes a ``PoolError`` before anything is written, and
a beat fire or manual start the pools refuse is dropped with one warning.

The warning, on the ``pools`` logger, reads word for word::

    Job <name> could not enter pool <pool>: <reason>

where ``<name>`` is the ``periodic_task_name`` header django-celery-beat (and "Run now")
sets, else the task name. A beat fire is dropped (beat goes on with its other jobs); a
manual start logs the same line and raises, so the REST API and the admin can answer.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kombu.exceptions import EncodeError

from pools import conf
from pools.exceptions import MessageTooLarge, PoolError, UnserializableArguments

#: The logger of the dropped-job warning (the package's root logger).
logger = logging.getLogger("pools")


class UnserializableCall(UnserializableArguments, EncodeError):
    """:class:`~pools.exceptions.UnserializableArguments` that is also kombu's ``EncodeError``."""


def as_pool_error(exc: BaseException, task: str) -> PoolError | None:
    """``exc`` as the pool error the caller gets, or None when it is not a refusal."""
    if isinstance(exc, PoolError):
        return exc
    if isinstance(exc, EncodeError):
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return UnserializableCall(task, reason)
    return None


def check_size(task: str, body: bytes) -> None:
    """Raise :class:`MessageTooLarge` for a body above ``POOLS['MAX_MESSAGE_BYTES']``."""
    limit = conf.get().MAX_MESSAGE_BYTES
    if len(body) > limit:
        raise MessageTooLarge(task, len(body), limit)


def is_beat_fire(headers: Any, origin: str | None) -> bool:
    """A call sent by celery beat (not a manual start, which names its own origin)."""
    if origin is not None or not isinstance(headers, Mapping):
        return False
    return bool(headers.get("periodic_task_name") or headers.get("celery_beat_task"))


def periodic_name(headers: Any) -> str:
    """The ``periodic_task_name`` header of a beat fire or manual start, else ""."""
    name = headers.get("periodic_task_name") if isinstance(headers, Mapping) else None
    return str(name or "")


def job_name(headers: Any, task: str) -> str:
    """The job's name: the ``periodic_task_name`` header, else the task name."""
    name = headers.get("periodic_task_name") if isinstance(headers, Mapping) else None
    return str(name or task)


def pool_of(exc: BaseException, pools: list[str]) -> str:
    """The pool a refusal names, else every pool of the demand."""
    pool = getattr(exc, "pool", None)
    return str(pool) if pool else ", ".join(pools) or "?"


def reason_of(exc: BaseException) -> str:
    """The refusal's message, on one line."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def warn_dropped(name: str, pool: str, exc: BaseException) -> None:
    """Log the one warning of a job that could not enter its pool."""
    logger.warning("Job %s could not enter pool %s: %s", name, pool, reason_of(exc))


def warn_skipped(name: str, pool: str, reason: str) -> None:
    """The warning of a beat fire that was not queued (``skip`` or a held idempotency key)."""
    logger.warning("Job %s could not enter pool %s: %s", name, pool, reason)
