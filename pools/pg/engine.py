"""The PostgreSQL engine: enqueue, start and settle as one call of a stored function each.

The functions (``pools/pg/sql/schema.sql``, named by :mod:`pools.pg.functions`, called
through :mod:`pools.pg.fastpath`) implement ``docs/concepts/contract.md`` as the ORM engine
(:mod:`pools.core.engines.orm`) does. What they leave to the ORM engine is decided by one
rule, :func:`handed_to_orm`. Requeue and the admission pass are the ORM engine's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from pools import conf
from pools.core import dispatch, events, rated_pools, rates, settling
from pools.core.engines.orm import OrmEngine
from pools.core.enqueueing import shown
from pools.core.pass_runs import (
    admit_after_settle,
    admit_later,
    follow_up,
    requeue_unpublished,
)
from pools.core.records import Admission, Claim, Enqueued, Submission
from pools.core.starts import Postponed
from pools.exceptions import DemandExceedsCapacity, PoolFull, UnknownPool
from pools.pg import fastpath, functions

logger = logging.getLogger("pools.core.admission")


@dataclass(frozen=True)
class Handoff:
    """What the PostgreSQL engine leaves to the ORM engine (:func:`handed_to_orm`)."""

    #: The whole call: the ORM engine runs it (nothing was written by a function).
    call: bool = False
    #: Pools whose admission pass the ORM engine runs after the call committed.
    pools: frozenset[str] = frozenset()


def handed_to_orm(
    *, sub: Submission | None = None, budgeted: bool = False, reply: fastpath.Reply | None = None
) -> Handoff:
    """The one rule by which the PostgreSQL engine hands work to the ORM engine.

    Before an enqueue (``sub``): a submit that is not plain (a job, a policy, an
    idempotency key, a pinned worker, a debounce key) or of a run with a budget (``budgeted``) is the ORM
    engine's whole call. After a call (``reply``): a ``policy`` refusal (a pool's paused,
    draining or overflow policy decides; the function wrote nothing) is too; each
    ``fallback`` row names a pool whose admission pass the ORM engine runs after commit
    (a multi-pool head, a head past its deadline, due multi-pool entries, a head that may be
    ineligible, a draining pool, a pool with a spend cap, a paused pool whose backoff has
    ended). The start of an entry admitted in a rated pool is not ``start``: the worker
    calls :func:`pools.core.leases.start_rated` for a message marked ``rated`` (see
    :func:`_on_commit`), whose checks are this engine's ``try_start_rated``. See
    docs/concepts/contract.md.
    """
    if sub is not None and (budgeted or not sub.plain):
        return Handoff(call=True)
    if reply is None:
        return Handoff()
    refused = reply.first("refused")
    if refused is not None and refused.reason == "policy":
        return Handoff(call=True)
    return Handoff(pools=frozenset(reply.fallbacks))


def missing_functions() -> list[str]:
    """The stored functions this code calls (``functions.VERSION``) that the default
    database lacks, in the order of ``functions.BASES``: all of them on a database that
    ``manage.py migrate pools`` has not brought to this release yet. One catalog query;
    database errors propagate."""
    wanted = [functions.name(base) for base in functions.BASES]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT DISTINCT proname FROM pg_catalog.pg_proc "
            "WHERE proname = ANY(%s) AND pg_catalog.pg_function_is_visible(oid)",
            [wanted],
        )
        found = {row[0] for row in cursor.fetchall()}
    return [name for name in wanted if name not in found]


class PostgresEngine(OrmEngine):
    """Enqueue, start and settle as stored-function calls.

    Requeue (rare) and the admission pass (sweeps, wake-ups, capacity changes) are the ORM
    engine's, inherited.
    """

    name = "postgresql"
    own_worker_connection = True

    def enqueue(
        self, sub: Submission, now: datetime, deadline: datetime | None, *, budgeted: bool
    ) -> Enqueued:
        """One call of the enqueue function, unless :func:`handed_to_orm` says otherwise."""
        if not handed_to_orm(sub=sub, budgeted=budgeted).call:
            enqueued = _enqueue_in_one_call(sub, now, deadline)
            if enqueued is not None:
                return enqueued
        return super().enqueue(sub, now, deadline, budgeted=budgeted)

    def start(self, entry_id: int, token: int, *, worker: str) -> Claim | None:
        """One call of the start function."""
        reply = fastpath.call(
            functions.name("start"),
            [
                entry_id,
                token,
                worker,
                timezone.now(),
                conf.get().LEASE_SECONDS,
                fastpath.listening(),
            ],
            what="starting a claim",
        )
        row = reply.first("started")
        if row is None or row.at is None:
            return None
        events.announce(reply.events, committed=reply.committed)
        return Claim(
            entry_id=entry_id, token=token, demand=dict(row.demand or {}), lease_expires_at=row.at
        )

    def try_start_rated(
        self, entry_id: int, token: int, *, worker: str
    ) -> Claim | Postponed | None:
        """One call of the rated start function (one check of :mod:`pools.core.starts`'
        rule, under the pools' locks), then the look for work left to their holder."""
        reply = fastpath.call(
            functions.name("start_rated"),
            [
                entry_id,
                token,
                worker,
                timezone.now(),
                conf.get().LEASE_SECONDS,
                rates.HANDOFF_MARGIN.total_seconds(),
                fastpath.listening(),
            ],
            what=f"starting entry {entry_id}",
        )
        wait, row = reply.first("wake"), reply.first("started")
        answer = wait or row
        if answer is not None and answer.demand:
            names = sorted(answer.demand)  # their locks were held: look after the commit
            transaction.on_commit(lambda: recheck_safely(names))
        if wait is not None and wait.at is not None:
            seconds = float((wait.detail or {}).get("seconds", 0.0))
            return Postponed(until=wait.at, seconds=seconds)
        if row is None or row.at is None:
            return None
        events.announce(reply.events, committed=reply.committed)
        return Claim(
            entry_id=entry_id, token=token, demand=dict(row.demand or {}), lease_expires_at=row.at
        )

    def settle(
        self, entry_id: int, token: int, outcome: str, *, reason: str, live_lease: bool
    ) -> bool:
        """One call of the settle function, then the passes it hands to the ORM engine."""
        return _settle_in_one_call(entry_id, token, outcome, reason, live_lease)

    def wake(self, names: Iterable[str]) -> list[Admission]:
        """A timed wake-up that never queues for a lock: :func:`wake`."""
        if connection.in_atomic_block:
            return super().wake(names)
        return wake(names)


#: The PostgreSQL engine (it keeps no state; pools' own connection is :mod:`fastpath`'s).
POSTGRESQL = PostgresEngine()


def _enqueue_in_one_call(
    sub: Submission, now: datetime, deadline: datetime | None
) -> Enqueued | None:
    """:func:`pools.core.admission.enqueue` as one call of the enqueue function (PostgreSQL fast path).

    ``None`` when a pool policy decides the enqueue (the function wrote nothing): the
    ORM engine then runs it.
    """
    spec = sub.spec
    reply = _call(
        "enqueue",
        sorted(spec.demand),
        [
            sub.key,
            sub.task_name,
            fastpath.jsonb(shown(sub.args)),
            fastpath.jsonb(shown(sub.kwargs)),
            fastpath.jsonb(sub.options),
            fastpath.jsonb(dict(spec.demand)),
            spec.priority,
            now,
            sub.not_before,
            deadline,
            sub.origin,
            sub.root_id or "",
            sub.parent_id or "",
            sub.attempt,
            conf.get().LEASE_SECONDS,
            fastpath.listening(),
            sub.fairness_key,
        ],
        what=f"pools {', '.join(sorted(spec.demand))}",
    )
    handoff = handed_to_orm(reply=reply)
    if handoff.call:
        return None
    refused = reply.first("refused")
    if refused is not None:
        pool = refused.pool or ""
        if refused.reason == "unknown":
            raise UnknownPool(pool)
        if refused.reason == "capacity":
            raise DemandExceedsCapacity(pool, refused.asked or 0, refused.limit or 0)
        raise PoolFull(pool, refused.limit or 0)
    enqueued = reply.first("enqueued")
    if enqueued is None or enqueued.entry is None:  # pragma: no cover - function contract
        raise RuntimeError(f"{functions.name('enqueue')} returned neither refused nor enqueued")
    admissions = _on_commit(reply)
    admissions += follow_up(set(handoff.pools))
    return Enqueued(
        entry_id=enqueued.entry,
        key=sub.key,
        admitted=any(a.entry_id == enqueued.entry for a in admissions),
    )


def _call(base: str, pools: list[str] | None, params: list[Any], *, what: str) -> fastpath.Reply:
    """Enqueue or settle: outside a transaction the procedure (``<base>_call``), which does
    not wait for a pool another call holds and looks again for work left to it after it
    commits; inside the caller's transaction the function, which waits for the locks, and
    the look again after the caller commits (:func:`recheck`; ``pools``: the pools it
    locks, ``None`` for those of the settled entry, which the function's ``settled`` row
    names). See docs/concepts/admission.md#contention.
    """
    if not connection.in_atomic_block:
        return fastpath.call_procedure(
            functions.name(f"{base}_call"), [*params, fastpath.lock_ms()], what=what
        )
    reply = fastpath.call(functions.name(base), params, what=what)
    if pools is None:
        settled = reply.first("settled")
        pools = sorted(settled.demand or {}) if settled is not None else []
    if pools:
        transaction.on_commit(lambda: recheck_safely(pools))
    return reply


def wake(names: Iterable[str]) -> list[Admission]:
    """A timed wake-up's pass over ``names``, left to the lock holder when there is one.

    Every process that saw a head due later schedules its own wake-up for that time, so
    several arrive together; as passes they would queue on the pools' locks one behind
    the other (a convoy that delays every settle of those pools). Instead each commits an
    owed pass (:func:`fastpath.owe_pass`) and looks as a holder does after its commit
    (:func:`recheck`, which skips a locked pool): the first admits, the others find the
    pools locked or the work taken, and a holder that took the locks before the owed pass
    committed runs it after its own commit. A pool the function hands to the ORM engine
    (a multi-pool head, a backoff that has ended, ...) gets its Python pass from
    :func:`recheck`, as after a settle.
    """
    wanted = sorted(set(names))
    if not wanted:
        return []
    fastpath.owe_pass(wanted, what=f"pools {', '.join(wanted)}")
    return recheck(wanted)


def recheck(names: Iterable[str]) -> list[Admission]:
    """After a commit that held the row locks of ``names``: admit what calls that found
    those pools locked left to the holder (owed releases, entries put in line), and hand
    the admissions to the after-commit hooks (``pools_recheck`` in ``schema.sql``)."""
    wanted = sorted(set(names))
    if not wanted:
        return []
    reply = fastpath.call_procedure(
        functions.name("recheck"),
        [
            wanted,
            timezone.now(),
            conf.get().LEASE_SECONDS,
            fastpath.listening(),
            fastpath.lock_ms(),
        ],
        what=f"pools {', '.join(wanted)}",
    )
    admissions = _on_commit(reply)
    return admissions + follow_up(set(handed_to_orm(reply=reply).pools))


def recheck_safely(names: Iterable[str]) -> None:
    """:func:`recheck` after a commit: an error is logged, never raised (what it would have
    admitted waits for the next call on those pools, or the sweep's pass)."""
    try:
        recheck(names)
    except Exception:
        logger.warning(
            "pools %s: the look for work left to the lock holder failed",
            ", ".join(sorted(set(names))),
            exc_info=True,
        )


def _on_commit(reply: fastpath.Reply) -> list[Admission]:
    """Hand a fast-path call's admissions, wake-ups and events to the after-commit hooks.

    An admission in a pool with a rate is marked ``rated``: its start then confirms its
    place in the pool's window of starts (:func:`pools.core.leases.start_rated`).
    """
    admitted = reply.of("admitted")
    rated = (
        rated_pools.of({row.pool or "" for row in admitted}, read=fastpath.pool_rates)
        if admitted
        else frozenset()
    )
    admissions = [
        Admission(
            entry_id=row.entry or 0,
            key=row.key or "",
            token=row.token or 0,
            task_name=row.task or "",
            args=row.args,
            kwargs=row.kwargs,
            options=row.options,
            rated=(row.pool or "") in rated,
        )
        for row in admitted
    ]
    # Publishing first: a signal receiver that raises must not keep a message from the broker.
    dispatch.after_commit(
        admissions, [], reply.wake, committed=reply.committed, requeue=requeue_unpublished
    )
    events.announce(reply.events, committed=reply.committed)
    return admissions


def _settle_in_one_call(
    entry_id: int, token: int, outcome: str, reason: str, live_lease: bool
) -> bool:
    """:func:`pools.core.admission.settle` as one call of the settle function (PostgreSQL fast path)."""
    reply = _call(
        "settle",
        None,
        [
            entry_id,
            token,
            outcome,
            reason,
            live_lease,
            timezone.now(),
            conf.get().LEASE_SECONDS,
            fastpath.listening(),
        ],
        what=f"settling entry {entry_id}",
    )
    settled = reply.first("settled")
    if settled is None:
        return False
    _on_commit(reply)
    job = (settled.detail or {}).get("job", "")
    # As settle() on the ORM path: one pass over the pools the function left to Python
    # (the pass settle() runs under its locks), then one follow-up over the pools that
    # pass needs and those of waiting 'forbid' instances of the job. Merging the two
    # would run the first pass with more pools locked (a due multi-pool entry could then
    # join a line that the ORM path's first pass admits from without it).
    handed = set(handed_to_orm(reply=reply).pools)
    try:
        needs = admit_after_settle(handed, settled=entry_id)
    except Exception as exc:  # the settle has committed: it stands (see follow_up)
        admit_later(handed, exc)
        needs = set()
    follow_up(needs | settling.forbid_waiters(job, settled.demand or {}))
    return True
