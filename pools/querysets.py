"""Named queries. Filters on entry state live here, not copied around the code."""

from __future__ import annotations

from contextlib import nullcontext
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.apps import apps
from django.db import connections, models, transaction
from django.db.models import Count, IntegerField, OuterRef, Subquery, Sum
from django.db.models.functions import Coalesce

if TYPE_CHECKING:
    pass

_HELD = ("admitted", "running")
#: The order of a pool's line (``pools_demand_line``), for every strategy.
LINE_ORDER = ("line_round", "line_at", "entry_id")


class QueueEntryQuerySet(models.QuerySet[Any]):
    """Queries over queue entries."""

    def update(self, **kwargs: Any) -> int:
        """On MySQL/MariaDB, update by primary key after locking the rows by primary key
        (:func:`update_by_primary_key`: avoids index-scan deadlocks)."""
        if connections[self.db].vendor == "mysql":
            return update_by_primary_key(self, **kwargs)
        return super().update(**kwargs)

    def waiting(self) -> QueueEntryQuerySet:
        """Entries in line for admission."""
        return self.filter(state="waiting")

    def held(self) -> QueueEntryQuerySet:
        """Entries holding slots (admitted or running)."""
        return self.filter(state__in=_HELD)

    def active(self) -> QueueEntryQuerySet:
        """Entries that are not finished (waiting or holding)."""
        return self.filter(state__in=("waiting", *_HELD))

    def for_pool(self, name: str) -> QueueEntryQuerySet:
        """Entries that name pool ``name``."""
        return self.filter(demands__pool__name=name)

    def lapsed(self, now: datetime) -> QueueEntryQuerySet:
        """Held entries whose lease has run out."""
        return self.held().filter(lease_expires_at__lt=now)

    def in_line_order(self) -> QueueEntryQuerySet:
        """Admission order: priority descending, then enqueue time, then queue id."""
        return self.order_by("-priority", "enqueued_at", "queue_id")


class DemandQuerySet(models.QuerySet[Any]):
    """Queries over per-pool demand rows."""

    def waiting(self) -> DemandQuerySet:
        """Rows of entries in line."""
        return self.filter(state="waiting")

    def delayed(self) -> DemandQuerySet:
        """Rows of waiting entries that are not due yet (out of line)."""
        return self.filter(state="delayed")

    def queued(self) -> DemandQuerySet:
        """Rows of every waiting entry, due or not (the backlog ``max_queued`` limits)."""
        return self.filter(state__in=("waiting", "delayed"))

    def due(self, pool_ids: list[int], now: datetime) -> DemandQuerySet:
        """Delayed rows of these pools whose time has come (served by ``pools_demand_delayed``)."""
        return self.filter(pool_id__in=pool_ids, state="delayed", enqueued_at__lte=now)

    def held(self) -> DemandQuerySet:
        """Rows of entries that hold their slots."""
        return self.filter(state__in=_HELD)

    def line(self, pool_id: int) -> DemandQuerySet:
        """The waiting line of one pool, head first (served by the ``pools_demand_line`` index).

        One order for every strategy: the strategy set each row's place when it joined
        (:mod:`pools.core.strategies`).
        """
        return self.filter(pool_id=pool_id, state="waiting").order_by(*LINE_ORDER)

    def held_slots(self, pool_id: int) -> int:
        """Slots held in one pool, summed from holding rows."""
        total = self.filter(pool_id=pool_id, state__in=_HELD).aggregate(n=models.Sum("slots"))["n"]
        return int(total or 0)


# --------------------------------------------------------------------------- per-pool figures
# Correlated subqueries for annotating pool lists: one query, whatever the number of pools.


def _demand() -> Any:
    # By name: models.py imports this module for its managers.
    return apps.get_model("pools", "Demand")


def held_slots_expr() -> Any:
    """``Pool`` annotation: slots held by admitted and running entries (0 when none)."""
    held = (
        _demand()
        .objects.filter(pool_id=OuterRef("pk"), state__in=_HELD)
        .order_by()
        .values("pool_id")
        .annotate(n=Sum("slots"))
        .values("n")
    )
    return Coalesce(Subquery(held, output_field=IntegerField()), 0)


def waiting_count_expr() -> Any:
    """``Pool`` annotation: entries in line (due waiting entries; 0 when none)."""
    waiting = (
        _demand()
        .objects.filter(pool_id=OuterRef("pk"), state="waiting")
        .order_by()
        .values("pool_id")
        .annotate(n=Count("pk"))
        .values("n")
    )
    return Coalesce(Subquery(waiting, output_field=IntegerField()), 0)


def update_by_primary_key(queryset: models.QuerySet[Any], **values: Any) -> int:
    """``queryset.update(**values)`` that locks only the rows it changes (MySQL/MariaDB).

    MariaDB's single-table ``UPDATE`` may read ``WHERE queue_id = 7 AND state = 'admitted'
    AND token = 1`` through the ``(state, lease_expires_at)`` index instead of the primary
    key. It then locks the index records of *other* entries in that state while it
    scans, and two workers starting two different entries deadlock (error 1213, seen in
    the contention proof). A ``SELECT ... FOR UPDATE`` with the same filter reads by
    primary key (a constant lookup), and the ``UPDATE`` then names primary keys only.
    One query more per update, on MySQL/MariaDB only (see ``QueueEntryQuerySet.update``).
    """
    db = connections[queryset.db]
    guard = nullcontext() if db.in_atomic_block else transaction.atomic(using=queryset.db)
    with guard:
        pks = list(queryset.select_for_update().values_list("pk", flat=True))
        if not pks:
            return 0
        rows = queryset.model._base_manager.using(queryset.db).filter(pk__in=pks)
        return models.QuerySet.update(rows, **values)
