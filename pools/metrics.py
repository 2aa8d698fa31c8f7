"""Prometheus metrics, read from the database at scrape time (the ``metrics`` extra).

``path("metrics/pools/", include("pools.metrics"))`` mounts :func:`metrics_view`. The
collector reads the pools' rows, their lines and the event log when Prometheus scrapes:
the same numbers whichever process answers, nothing kept in process memory, so prefork
workers and several web processes need no multiprocess setup. ``prometheus_client`` is
imported only when a scrape happens: the rest of the package never needs it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.core.exceptions import PermissionDenied
from django.db.models import Count, DurationField, ExpressionWrapper, F, Q, Sum
from django.http import HttpRequest, HttpResponse
from django.urls import path
from django.utils import timezone

from pools.core import rates, spendcap
from pools.exceptions import PoolConfigurationError
from pools.models import Demand, Pool, PoolEvent, RunBudget
from pools.states import EntryState, EventKind

#: Event kinds counted as refusals (entries that ended without running), by ``reason``.
#: An entry dropped by a full pool's overflow policy ends ``rejected`` (its event too).
REFUSALS = {
    EventKind.EXPIRED: "expired",
    EventKind.CANCELLED: "cancelled",
    EventKind.REJECTED: "rejected",
    EventKind.SUPERSEDED: "superseded",
}


#: Upper bounds (seconds) of the wait-time histogram's buckets (``+Inf`` is added).
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
#: The wait-time histogram covers entries that joined a line this recently.
WAIT_WINDOW = timedelta(minutes=15)


@dataclass(frozen=True, kw_only=True)
class WaitHistogram:
    """Waits from joining a pool's line to admission, of the entries that joined it
    within :data:`WAIT_WINDOW` and have been admitted since."""

    #: Cumulative counts: ``(upper bound in seconds, entries that waited at most that)``,
    #: the last bound ``inf`` (every entry).
    buckets: list[tuple[float, int]]
    #: Total of the waits, in seconds.
    total_seconds: float


@dataclass(frozen=True, kw_only=True)
class PoolMetrics:
    """The numbers of one pool at one scrape."""

    pool: str
    #: Slots in effect (``inf`` for a pool limited by a rate only).
    capacity: float
    held: int
    waiting: int
    paused: bool
    #: Admissions since the pool was created (the pool's own counter).
    admissions: int
    #: Requeues in the event log (lease lapsed or lost, publish failed).
    lease_losses: int
    #: Entries that ended without running, by reason, from the event log.
    refusals: dict[str, int] = field(default_factory=dict)
    #: Recent waits (``None``: no entry joined and left the line within the window).
    waits: WaitHistogram | None = None
    #: Daily spend cap in slot-seconds (``None``: no cap) and the spend of today (UTC).
    spend_cap: float | None = None
    spent_today: float = 0.0
    #: Backoffs asked of the pool so far (``raise pools.Backoff``), and the seconds left of
    #: the one running now (0: not backing off).
    backoffs: int = 0
    backoff_seconds: float = 0.0


def read() -> list[PoolMetrics]:
    """Every pool's metrics: four grouped queries, whatever the number of entries."""
    waiting = dict(
        Demand.objects.filter(state=EntryState.WAITING)
        .values_list("pool__name")
        .annotate(n=Count("id"))
        .order_by()
    )
    losses = dict(
        PoolEvent.objects.filter(kind=EventKind.REQUEUED)
        .values_list("pool")
        .annotate(n=Count("id"))
        .order_by()
    )
    refusals: dict[str, dict[str, int]] = {}
    rows = (
        PoolEvent.objects.filter(kind__in=list(REFUSALS))
        .values_list("pool", "kind")
        .annotate(n=Count("id"))
        .order_by()
    )
    for pool, kind, n in rows:
        refusals.setdefault(pool, {})[REFUSALS[EventKind(kind)]] = n
    waits = read_waits()
    day = spendcap.today()
    fields = ("name", "slots", "held", "paused", "admissions", "spend_cap", "spend_day")
    now = timezone.now()
    return [
        PoolMetrics(
            pool=p.name,
            capacity=float("inf") if p.slots >= rates.UNLIMITED_SLOTS else p.slots,
            held=p.held,
            waiting=waiting.get(p.name, 0),
            paused=p.paused,
            admissions=p.admissions,
            lease_losses=losses.get(p.name, 0),
            refusals=refusals.get(p.name, {}),
            waits=waits.get(p.name),
            spend_cap=p.spend_cap,
            spent_today=spendcap.spent(p, day) if p.spend_cap is not None else 0.0,
            backoffs=p.backoffs,
            backoff_seconds=(
                max((p.backoff_until - now).total_seconds(), 0.0) if p.backoff_until else 0.0
            ),
        )
        for p in Pool.objects.order_by("name").only(
            *fields, "spent_today", "backoffs", "backoff_until"
        )
    ]


def read_budget_stops() -> dict[str, int]:
    """Runs stopped by a budget, by the budget that stopped them (``seconds``, ``cost``,
    ``tokens``): one grouped query over the run budgets still kept."""
    return dict(
        RunBudget.objects.exclude(exhausted_by="")
        .values_list("exhausted_by")
        .annotate(n=Count("id"))
        .order_by()
    )


def read_waits(now: Any = None) -> dict[str, WaitHistogram]:
    """Per pool, the wait-time histogram of :class:`WaitHistogram`: one grouped query.

    Rows are found by the demand index ``(pool, enqueued_at)``: only lines joined within
    the window are read, whatever the size of the history.
    """
    cutoff = (now or timezone.now()) - WAIT_WINDOW
    wait = ExpressionWrapper(
        F("entry__admitted_at") - F("enqueued_at"), output_field=DurationField()
    )
    buckets = {
        f"le_{i}": Count("id", filter=Q(wait__lte=timedelta(seconds=bound)))
        for i, bound in enumerate(WAIT_BUCKETS)
    }
    rows = (
        Demand.objects.filter(
            pool_id__in=Pool.objects.values("pk"),
            enqueued_at__gte=cutoff,
            entry__admitted_at__isnull=False,
        )
        .annotate(wait=wait)
        .values("pool__name")
        .annotate(n=Count("id"), total=Sum("wait"), **buckets)
        .order_by()
    )
    out = {}
    row: dict[str, Any]
    for row in rows:  # type: ignore[assignment]  # the bucket keys are made at run time
        counts = [(bound, int(row[f"le_{i}"])) for i, bound in enumerate(WAIT_BUCKETS)]
        total = row["total"]
        seconds = total.total_seconds() if isinstance(total, timedelta) else (total or 0) / 1e6
        out[row["pool__name"]] = WaitHistogram(
            buckets=[*counts, (float("inf"), int(row["n"]))], total_seconds=seconds
        )
    return out


def _prometheus() -> Any:
    try:
        import prometheus_client  # optional: imported at scrape time only
        import prometheus_client.core  # the metric families (not imported by the package)
    except ImportError:  # pragma: no cover - depends on the environment
        raise PoolConfigurationError(
            "Pool metrics need prometheus_client: pip install 'django-celery-pools[metrics]'."
        ) from None
    return prometheus_client


class PoolsCollector:
    """A ``prometheus_client`` collector: register it in your own registry, or use the view."""

    def collect(self) -> Iterator[Any]:
        """Yield the metric families of every pool (read from the database now)."""
        core = _prometheus().core
        gauges = {
            "capacity": core.GaugeMetricFamily(
                "pools_capacity_slots", "Slots in effect.", labels=["pool"]
            ),
            "held": core.GaugeMetricFamily(
                "pools_held_slots", "Slots held by admitted and running entries.", labels=["pool"]
            ),
            "waiting": core.GaugeMetricFamily(
                "pools_waiting_entries", "Entries waiting in line.", labels=["pool"]
            ),
            "paused": core.GaugeMetricFamily("pools_paused", "1 when paused.", labels=["pool"]),
            "backoff": core.GaugeMetricFamily(
                "pools_backoff_remaining_seconds",
                "Seconds left of the pool's backoff (0: not backing off).",
                labels=["pool"],
            ),
        }
        backoffs = core.CounterMetricFamily(
            "pools_backoffs",
            "Backoffs asked of the pool by task bodies (raise pools.Backoff).",
            labels=["pool"],
        )
        admissions = core.CounterMetricFamily(
            "pools_admissions", "Admissions since the pool was created.", labels=["pool"]
        )
        losses = core.CounterMetricFamily(
            "pools_lease_losses",
            "Held entries put back in line (lease lapsed or lost, publish failed).",
            labels=["pool"],
        )
        refusals = core.CounterMetricFamily(
            "pools_refusals",
            "Entries that ended without running, by reason.",
            labels=["pool", "reason"],
        )
        spend = {
            "cap": core.GaugeMetricFamily(
                "pools_spend_cap_slot_seconds",
                "Daily spend cap in slot-seconds per UTC day (pools with a cap only).",
                labels=["pool"],
            ),
            "spent": core.GaugeMetricFamily(
                "pools_spent_today_slot_seconds",
                "Slot-seconds spent on the current UTC day (pools with a cap only).",
                labels=["pool"],
            ),
        }
        budget_stops = core.CounterMetricFamily(
            "pools_budget_stops",
            "Runs stopped because they spent a budget, by budget (seconds, cost, tokens).",
            labels=["budget"],
        )
        waits = core.GaugeHistogramMetricFamily(
            "pools_wait_seconds",
            "Wait from joining the line to admission, of entries that joined it in the "
            f"last {int(WAIT_WINDOW.total_seconds())} s and have been admitted.",
            labels=["pool"],
        )
        for m in read():
            gauges["capacity"].add_metric([m.pool], m.capacity)
            gauges["held"].add_metric([m.pool], m.held)
            gauges["waiting"].add_metric([m.pool], m.waiting)
            gauges["paused"].add_metric([m.pool], 1 if m.paused else 0)
            gauges["backoff"].add_metric([m.pool], m.backoff_seconds)
            backoffs.add_metric([m.pool], m.backoffs)
            admissions.add_metric([m.pool], m.admissions)
            losses.add_metric([m.pool], m.lease_losses)
            for reason, n in sorted(m.refusals.items()):
                refusals.add_metric([m.pool, reason], n)
            if m.spend_cap is not None:
                spend["cap"].add_metric([m.pool], m.spend_cap)
                spend["spent"].add_metric([m.pool], m.spent_today)
            if m.waits is not None:
                waits.add_metric(
                    [m.pool],
                    [(_le(bound), n) for bound, n in m.waits.buckets],
                    gsum_value=m.waits.total_seconds,
                )
        yield from gauges.values()
        yield admissions
        yield losses
        yield backoffs
        yield refusals
        yield waits
        yield from spend.values()
        for budget, n in sorted(read_budget_stops().items()):
            budget_stops.add_metric([budget], n)
        yield budget_stops


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


def exposition() -> tuple[bytes, str]:
    """The metrics in Prometheus' text format, and its content type."""
    client = _prometheus()
    registry = client.CollectorRegistry(auto_describe=False)
    registry.register(PoolsCollector())
    return client.generate_latest(registry), client.CONTENT_TYPE_LATEST


def public_metrics_view(request: HttpRequest) -> HttpResponse:
    """The metrics for anyone who can reach the URL (protect it at the network level)."""
    body, content_type = exposition()
    return HttpResponse(body, content_type=content_type)


def metrics_view(request: HttpRequest) -> HttpResponse:
    """The metrics, for a logged-in user with the ``pools.view_pool`` permission."""
    if not request.user.has_perm("pools.view_pool"):
        raise PermissionDenied
    return public_metrics_view(request)


urlpatterns = [path("", metrics_view, name="pools-metrics")]
