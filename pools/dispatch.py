"""Hands admitted entries (and entries that ended while waiting) to the task runner.

The core does not know Celery: it calls the *bridge* named by ``POOLS["PUBLISHER"]``
(by default :mod:`pools.gate`) after the admitting transaction commits, so a
message is never published for a claim that was rolled back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from django.db import transaction
from django.utils.module_loading import import_string

from pools import conf

if TYPE_CHECKING:
    from pools.admission import Admission, Finished


class Bridge(Protocol):
    """What the core needs from a task runner."""

    def publish(self, admissions: Sequence[Admission]) -> None:
        """Publish the message of each admitted entry with its fencing token."""

    def report_finished(self, finished: Sequence[Finished]) -> None:
        """Record the outcome of entries that ended without running (expired, cancelled)."""

    def terminate(self, key: str) -> None:
        """Stop the admitted or running task ``key`` wherever it is."""


def bridge() -> Bridge:
    """The configured bridge object (a module or an object with the two methods)."""
    target: Bridge = import_string(conf.get().PUBLISHER)
    return target


def after_commit(admissions: Sequence[Admission], finished: Sequence[Finished]) -> None:
    """Schedule publishing/reporting for when the current transaction commits."""
    if admissions:
        transaction.on_commit(lambda: bridge().publish(admissions))
    if finished:
        transaction.on_commit(lambda: bridge().report_finished(finished))
