"""Why is it waiting: an entry's place in each pool it asks for, what blocks it, and an ETA.

Read-only, no locks: the answer is a point-in-time view that may be stale by the time it
is shown (an entry may be admitted a millisecond later).

**Position** is the 1-based place of an entry in a pool's line, counted by
:mod:`pools.core.line_places`. An entry whose ``not_before`` is still in the future is not
in line: no position.

**blocked_by** is one of a closed set (:data:`BLOCKERS`), decided per pool in this order:

1. ``not_before``: the entry is not due yet (``detail["until"]``);
2. ``paused``: the pool is paused; ``spend_cap``: the pool has spent its daily spend cap
   (slot-seconds per UTC day; ``detail["spent"]``, ``detail["cap"]``, ``detail["until"]``);
   ``rate_limited``: a rate of the pool (:mod:`pools.core.rates`) has no room for the
   pool's next admission (``detail["rate"]``, ``detail["until"]``: when its window opens);
   then, for the first entry in line that is ineligible (:mod:`pools.core.eligibility`):
   ``forbid`` (``concurrency_policy="forbid"`` and another instance of its job is admitted
   or running: ``detail["job"]``, ``detail["holder"]``) or ``worker_unavailable`` (pinned
   to a worker without a live heartbeat: ``detail["worker"]``);
3. ``pool_full``: the pool has no free slot for the first entries of its line
   (``detail["holders"]``: who holds the slots);
4. ``head_of_line``: an entry ahead (``detail["ahead"]``, the head of the line) needs more
   slots than are free, or is ineligible (``detail["ahead"]["blocked_by"]``), and nothing
   passes it (no backfill);
5. ``other_pool``: admissible in this pool, but waiting for another pool it also names
   (``detail["pool"]``).

Workflow caps are pools too (``run-cap:<root id>``, ``task-cap:<task>``): their places
come first, run cap then task cap, then the named pools by name, and a full cap pool
reports ``run_cap`` / ``task_cap`` instead of ``pool_full``.

``None`` means not blocked: admissible now (the next admission pass takes it), or not
waiting at all (held or finished).

**ETA** (:func:`pools.core.line_places.estimate_eta`, from the pool's recent hold
times): ``None`` when the pool has no such history or is paused; the due time for a
delayed entry (at the earliest); ``now`` when nothing blocks it. In a pool with a rate, the
ETA is at least when the rates allow the entry's start (the ``ahead + 1``-th next
admission, from the marks).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from pools.core import eligibility, spendcap, windows
from pools.core.line_places import capacity, eta_from, hold_times, mean_hold, position_of
from pools.core.records import DEBOUNCE_SECONDS_OPTION, DEBOUNCED_OPTION
from pools.exceptions import EntryNotFound
from pools.models import Demand, Pool, QueueEntry
from pools.pool_names import CAP_PREFIXES, gate_rank
from pools.states import HELD_STATES, EntryState

#: The closed set of ``blocked_by`` values.
BLOCKERS = (
    "pool_full",
    "head_of_line",
    "paused",
    "not_before",
    "other_pool",
    "worker_unavailable",
    "forbid",
    "run_cap",
    "task_cap",
    "spend_cap",
    "rate_limited",
)


@dataclass(frozen=True, kw_only=True)
class PoolPlace:
    """One pool an entry asks for, and where the entry stands in it."""

    #: Pool name.
    pool: str
    #: Slots the entry asks of this pool.
    slots: int
    #: 1-based place in the pool's line; ``None`` when not in line (delayed, held, finished).
    position: int | None
    #: One of :data:`BLOCKERS`; ``None`` when admissible now or not waiting.
    blocked_by: str | None
    #: One human sentence.
    message: str
    #: Machine-readable detail: ``holders``, ``ahead``, ``until``, ``pool``, ``free``, ...
    detail: dict[str, Any] = field(default_factory=dict)
    #: Estimated admission time (see the module docstring); ``None`` when unknown.
    eta: datetime | None = None


@dataclass(frozen=True, kw_only=True)
class Explanation:
    """An entry and its place in each pool it asks for (by pool name)."""

    entry: QueueEntry
    places: list[PoolPlace]

    @property
    def eta(self) -> datetime | None:
        """When the entry may be admitted: the latest ETA over its pools (``None`` if any is)."""
        if self.entry.state != EntryState.WAITING or not self.places:
            return None
        etas = [p.eta for p in self.places]
        if any(e is None for e in etas):
            return None
        return max(e for e in etas if e is not None)

    @property
    def blocked_by(self) -> str | None:
        """The first blocker over the entry's pools (gate order: run cap, task cap, named
        pools by name), ``None`` if none; ``other_pool`` only when no pool has another."""
        found = [p.blocked_by for p in self.places if p.blocked_by]
        return next((b for b in found if b != "other_pool"), found[0] if found else None)


# --------------------------------------------------------------------------- small helpers


def label(queue_id: int) -> str:
    """How an entry is named in messages."""
    return f"#{queue_id}"


def _fmt(when: datetime) -> str:
    return timezone.localtime(when).strftime("%Y-%m-%d %H:%M:%S %Z")


# --------------------------------------------------------------------------- the decision


@dataclass(frozen=True, kw_only=True)
class PoolView:
    """What the decision needs to know of one pool (read by the caller, in bulk or not)."""

    pool: Pool
    #: Held demand rows of the pool, each with its entry loaded.
    holders: Sequence[Demand]
    #: Recent hold times (newest first), for the ETA.
    holds: Sequence[timedelta] = ()

    @property
    def held(self) -> int:
        """Slots held."""
        return sum(d.slots for d in self.holders)

    @property
    def free(self) -> int:
        """Slots free for admission (never negative)."""
        return max(capacity(self.pool) - self.held, 0)


def decide(
    view: PoolView,
    entry: QueueEntry,
    slots: int,
    position: int | None,
    head: Demand | None,
    now: datetime,
) -> PoolPlace:
    """The place of a *waiting* entry in one pool (``other_pool`` is settled by the caller).

    ``head`` is the first row of the pool's line (its entry loaded) when ``position > 1``.
    """
    pool = view.pool
    name = pool.name
    cap = capacity(pool)
    if entry.not_before is not None and (entry.not_before > now or position is None):
        until = entry.not_before
        detail: dict[str, Any] = {"until": until.isoformat()}
        message = (
            f"Not due before {_fmt(until)}: it joins the line of pool {name!r} then."
            if until > now
            else f"Due since {_fmt(until)}: it joins the line of pool {name!r} "
            f"at the next admission pass."
        )
        if entry.debounce_key is not None:
            detail.update(debounce_key=entry.debounce_key, **_debounce_detail(entry))
            if until > now:
                message = (
                    f"Debounced (key {entry.debounce_key!r}): waits for quiet until "
                    f"{_fmt(until)}; a new call with this key pushes the start later. It "
                    f"joins the line of pool {name!r} then."
                )
        return PoolPlace(
            pool=name,
            slots=slots,
            position=None,
            blocked_by="not_before",
            message=message,
            detail=detail,
            eta=max(until, now),
        )
    eta = eta_from(mean_hold(view.holds), cap, position, now)
    holders = [label(d.entry_id) for d in view.holders]
    holder_keys = [{"queue_id": d.entry_id, "key": d.entry.key} for d in view.holders]
    ahead = (position or 1) - 1
    behind = f" {ahead} entr{'y' if ahead == 1 else 'ies'} ahead." if ahead else ""
    if pool.paused:
        return PoolPlace(
            pool=name,
            slots=slots,
            position=position,
            blocked_by="paused",
            message=f"Pool {name!r} is paused: nothing is admitted until it is resumed.{behind}",
            detail={"ahead": ahead},
            eta=None,
        )
    if spendcap.is_capped(pool):
        until = spendcap.next_day()
        return PoolPlace(
            pool=name,
            slots=slots,
            position=position,
            blocked_by="spend_cap",
            message=f"Pool {name!r} has spent its daily spend cap "
            f"({spendcap.spent(pool):g} of {pool.spend_cap:g} slot-seconds): nothing is "
            f"admitted until the next UTC day.{behind}",
            detail={
                "ahead": ahead,
                "spent": spendcap.spent(pool),
                "cap": pool.spend_cap,
                "until": until.isoformat(),
            },
            eta=until,
        )
    if pool.rate:
        opens = windows.next_opening(pool)
        rate_eta = windows.next_opening(pool, ahead)
        if rate_eta is not None:
            rate_eta = windows.to_local(rate_eta)
            eta = None if eta is None else max(eta, rate_eta)
            eta = eta or rate_eta
        if opens is not None:
            until = windows.to_local(opens)
            rates = pool.rate.replace(",", ", ")
            return PoolPlace(
                pool=name,
                slots=slots,
                position=position,
                blocked_by="rate_limited",
                message=f"Pool {name!r} has used its rate ({rates}): its next start is "
                f"allowed at {_fmt(until)}.{behind}",
                detail={"ahead": ahead, "rate": pool.rate.split(","), "until": until.isoformat()},
                eta=eta,
            )
    first = head is None or position == 1
    own = eligibility.blocker(entry) if first and eligibility.is_special(entry) else None
    if own is not None:
        return PoolPlace(
            pool=name,
            slots=slots,
            position=position,
            blocked_by=own.kind,
            message=f"First in line of pool {name!r}, not eligible: {own.message}",
            detail={**own.detail, "ahead": ahead},
            eta=None,
        )
    first_slots = slots if first or head is None else head.slots
    if view.free == 0 or ((head is None or position == 1) and view.free < first_slots):
        return PoolPlace(
            pool=name,
            slots=slots,
            position=position,
            blocked_by="pool_full",
            message=(
                f"Pool {name!r} is full: {view.held} of {cap} slot(s) held"
                f"{' by ' + ', '.join(holders) if holders else ''}"
                f"{f'; it needs {slots}' if view.free else ''}.{behind}"
            ),
            detail={"holders": holder_keys, "free": view.free, "ahead": ahead},
            eta=eta,
        )
    if head is not None and position is not None and position > 1:
        head_label = label(head.entry_id)
        head_block = eligibility.blocker(head.entry) if eligibility.is_special(head.entry) else None
        ahead_detail: dict[str, Any] = {
            "queue_id": head.entry_id,
            "key": head.entry.key,
            "slots": head.slots,
        }
        if head_block is not None:
            why = f"is not eligible: {head_block.message}"
            ahead_detail["blocked_by"] = head_block.kind
        elif view.free < head.slots:
            why = f"needs {head.slots} slot(s) and only {view.free} of {cap} are free"
        else:
            why = "is waiting for its turn (or for another pool it names)"
        return PoolPlace(
            pool=name,
            slots=slots,
            position=position,
            blocked_by="head_of_line",
            message=(
                f"Behind {head_label} in pool {name!r}, first in line, which {why}; "
                f"nothing passes it.{behind}"
            ),
            detail={
                "ahead": ahead_detail,
                "free": view.free,
                "holders": holder_keys,
            },
            eta=eta,
        )
    return PoolPlace(
        pool=name,
        slots=slots,
        position=position,
        blocked_by=None,
        message=f"First in line of pool {name!r} with {view.free} slot(s) free: "
        f"admitted at the next admission pass.",
        detail={"free": view.free},
        eta=now,
    )


def mark_blocked_by_other_pool(places: list[PoolPlace]) -> list[PoolPlace]:
    """A pool that would admit the entry, while another pool it names blocks it: ``other_pool``."""
    blocking = next((p for p in places if p.blocked_by is not None), None)
    if blocking is None:
        return places
    out = []
    for p in places:
        if p.blocked_by is None:
            p = PoolPlace(
                pool=p.pool,
                slots=p.slots,
                position=p.position,
                blocked_by="other_pool",
                message=f"Admissible in pool {p.pool!r}, but it also waits for pool "
                f"{blocking.pool!r} ({blocking.blocked_by}); it takes both at once.",
                detail={"pool": blocking.pool, "reason": blocking.blocked_by},
                eta=blocking.eta,
            )
        out.append(p)
    return out


def _not_waiting(entry: QueueEntry, d: Demand) -> PoolPlace:
    name = d.pool.name
    if entry.state == EntryState.ADMITTED:
        lease = f" (lease until {_fmt(entry.lease_expires_at)})" if entry.lease_expires_at else ""
        # A fenced start writes nothing: a body shows as running from its first renewal.
        message = (
            f"Admitted: holds {d.slots} slot(s) of pool {name!r}{lease}; not started yet, "
            "or started less than a lease renewal ago."
        )
    elif entry.state == EntryState.RUNNING:
        message = (
            f"Running on {entry.worker or 'a worker'}: holds {d.slots} slot(s) of pool {name!r}."
        )
    else:
        reason = f" ({entry.reason})" if entry.reason else ""
        message = f"Finished: {entry.state}{reason}."
    return PoolPlace(
        pool=name, slots=d.slots, position=None, blocked_by=None, message=message, eta=None
    )


# --------------------------------------------------------------------------- entry points


def held_rows(pool_ids: Sequence[int]) -> dict[int, list[Demand]]:
    """Held demand rows per pool, entries loaded, in one query."""
    out: dict[int, list[Demand]] = {pid: [] for pid in pool_ids}
    rows = (
        Demand.objects.filter(pool_id__in=list(pool_ids), state__in=HELD_STATES)
        .select_related("entry")
        .order_by("entry_id")
    )
    for d in rows:
        out[d.pool_id].append(d)
    return out


def explain(entry: QueueEntry, *, now: datetime | None = None) -> Explanation:
    """Where ``entry`` stands in each pool it asks for, and why it waits.

    Queries: three, plus up to two per pool for a waiting entry (position and head).
    """
    now = now or timezone.now()
    demands = sorted(
        Demand.objects.filter(entry_id=entry.pk).select_related("pool"),
        key=lambda d: (gate_rank(d.pool.name), d.pool.name),
    )
    if entry.state != EntryState.WAITING:
        return Explanation(entry=entry, places=[_not_waiting(entry, d) for d in demands])
    pool_ids = [d.pool_id for d in demands]
    holders = held_rows(pool_ids)
    holds = hold_times(pool_ids, now)
    places = []
    for d in demands:
        view = PoolView(pool=d.pool, holders=holders[d.pool_id], holds=holds.get(d.pool_id, ()))
        in_line = d.state == EntryState.WAITING and not (
            entry.not_before is not None and entry.not_before > now
        )
        position = position_of(d) if in_line else None
        head = None
        if position is not None and position > 1:
            head = Demand.objects.line(d.pool_id).select_related("entry").first()
        places.append(_as_cap(decide(view, entry, d.slots, position, head, now)))
    return Explanation(entry=entry, places=mark_blocked_by_other_pool(places))


def _debounce_detail(entry: QueueEntry) -> dict[str, Any]:
    """A debounced entry's quiet time and how many earlier calls it collapsed."""
    options = entry.options if isinstance(entry.options, dict) else {}
    return {
        "quiet_seconds": options.get(DEBOUNCE_SECONDS_OPTION),
        "collapsed_calls": len(options.get(DEBOUNCED_OPTION) or []),
    }


def _as_cap(place: PoolPlace) -> PoolPlace:
    """A full workflow-cap pool reports ``run_cap`` / ``task_cap`` (not ``pool_full``)."""
    rank = gate_rank(place.pool)
    if place.blocked_by != "pool_full" or rank >= len(CAP_PREFIXES):
        return place
    kind = ("run_cap", "task_cap")[rank]
    what = "run cap (pools.limit_run)" if rank == 0 else "task cap (max_running)"
    return replace(place, blocked_by=kind, message=f"At its {what}: {place.message}")


def latest_entry(key: str) -> QueueEntry:
    """The latest entry with ``key`` (retries reuse a task id); raises :class:`EntryNotFound`."""
    entry = QueueEntry.objects.filter(key=key).order_by("-queue_id").first()
    if entry is None:
        raise EntryNotFound(key)
    return entry


def explain_key(key: str, *, now: datetime | None = None) -> Explanation:
    """:func:`explain` for the latest entry with ``key``; raises :class:`EntryNotFound`."""
    return explain(latest_entry(key), now=now)


def explain_many(
    entries: Sequence[QueueEntry], *, now: datetime | None = None
) -> Mapping[int, Explanation]:
    """:func:`explain` for a few entries (e.g. the tasks of one run), by queue id."""
    now = now or timezone.now()
    return {e.queue_id: explain(e, now=now) for e in entries}
