"""Pooled tasks used by the acceptance tests (run by real worker processes)."""

from __future__ import annotations

import json
import os
import time
from typing import Any, cast

from celery import Task, current_task, shared_task
from celery.result import AsyncResult

from pools import current_claim, pooled

#: Pool of the gate acceptance test; created by the test itself (not in settings).
ACCEPT_POOL = "accept3"
#: Pool of the run budget acceptance test; created by the test itself.
BUDGET_POOL = "budget-run"


@shared_task
@pooled("warehouse", slots=1)
def record(i: int, sleep: float = 0.05) -> dict:
    """Sleep briefly and return when (and where) the body ran."""
    start = time.time()
    time.sleep(sleep)
    claim = current_claim()
    return {
        "i": i,
        "start": start,
        "end": time.time(),
        "pid": os.getpid(),
        "token": claim.token if claim else None,
    }


@shared_task
@pooled("warehouse", slots=1)
def add(x: int, y: int) -> int:
    return x + y


@shared_task
@pooled("partner-api")
def tsum(values: list[int]) -> int:
    return sum(values)


def _span(i: int, sleep: float) -> dict:
    start = time.time()
    time.sleep(sleep)
    end = time.time()
    claim = current_claim()
    request = current_task.request if current_task else None
    return {
        "i": i,
        "start": start,
        "end": end,
        "pid": os.getpid(),
        "hostname": getattr(request, "hostname", None),
        "key": getattr(request, "id", None),
        "entry_id": claim.entry_id if claim else None,
        "token": claim.token if claim else None,
    }


@shared_task
@pooled(ACCEPT_POOL, slots=1)
def span(i: int, sleep: float = 0.03) -> dict:
    """Pooled on ``accept3``: sleep briefly, return when/where the body ran and its claim."""
    return _span(i, sleep)


@shared_task
def free_span(i: int, sleep: float = 0.3) -> dict:
    """The same body, not pooled: the control that shows the workers can overlap freely."""
    return _span(i, sleep)


@shared_task
@pooled("warehouse", slots=1)
def noted(path: str, x: int, y: int) -> int:
    """Add, appending one line per body execution to ``path`` (how often did the body run?)."""
    claim = current_claim()
    with open(path, "a") as out:
        out.write(json.dumps({"pid": os.getpid(), "token": claim.token if claim else None}) + "\n")
    return x + y


@shared_task
@pooled("warehouse", slots=1)
def noted_slowly(path: str, seconds: float, drop_fence: bool = False) -> int:
    """Append a ``start`` line, sleep ``seconds``, append an ``end`` line (to ``path``).

    ``drop_fence`` (a sabotage): release every advisory lock of this process's own
    connection first, the fence of its start included, as a broken fence would.
    """
    claim = current_claim()
    if drop_fence:
        from pools.pg import fastpath

        fastpath._connect().execute("SELECT pg_advisory_unlock_all()")
    line = {"pid": os.getpid(), "token": claim.token if claim else None}
    with open(path, "a") as out:
        out.write(json.dumps({**line, "event": "start", "at": time.time()}) + "\n")
    time.sleep(seconds)
    with open(path, "a") as out:
        out.write(json.dumps({**line, "event": "end", "at": time.time()}) + "\n")
    return os.getpid()


@shared_task
@pooled("partner-api")
def echo_request(value: object) -> dict:
    """Return what the body received and the request fields plain Celery would give it."""
    request = current_task.request
    return {
        "value": repr(value),
        "type": type(value).__name__,
        "eta": request.eta,
        "expires": request.expires,
        "retries": request.retries,
        "root_id": request.root_id,
        "parent_id": request.parent_id,
        "reply_to": request.reply_to,
        "correlation_id": request.correlation_id,
        "stamped": (request.headers or {}).get("custom_header"),
    }


@shared_task
@pooled("partner-api")
def stamp_time() -> float:
    """When the body ran (the 1-slot partner-api pool: one at a time)."""
    return time.time()


@shared_task
@pooled("partner-api")
def spawn_children(n: int) -> list[str]:
    """Call the pooled ``add`` ``n`` times from a body; return the ids on this task's trail."""
    for i in range(n):
        add.delay(i, i)
    # celery-types says list[str]; Celery appends the AsyncResult of each call made here.
    children = cast("list[AsyncResult[Any]]", current_task.request.children)
    return [r.id for r in children]


@shared_task(bind=True, acks_late=True)
@pooled("partner-api")
def reject_once(self: Task) -> str:
    """``Reject(requeue=True)`` unless the broker redelivered the message (Celery's own test)."""
    from celery.exceptions import Reject

    if not (self.request.delivery_info or {}).get("redelivered"):
        raise Reject("try again", requeue=True)
    return "second time"


@shared_task
@pooled(BUDGET_POOL)
def spend(
    label: str,
    cost: float = 0,
    tokens: int = 0,
    sleep: float = 0,
    spawn: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Sleep, charge the run, then start the ``spawn`` tasks (``priority`` per child).

    A child the run's budget refuses is reported as ``"refused: <message>"``.
    """
    from pools import BudgetExceeded, charge

    if sleep:
        time.sleep(sleep)
    charged = charge(cost=cost, tokens=tokens) if cost or tokens else None
    children: list[str] = []
    for child in spawn or []:
        kwargs = dict(child)
        priority = kwargs.pop("priority", 0)
        try:
            sent = spend.apply_async(kwargs=kwargs, pool_options={"priority": priority})  # type: ignore[call-arg]  # celery-types: no **options
            children.append(sent.id)
        except BudgetExceeded as exc:
            children.append(f"refused: {exc}")
    return {"label": label, "children": children, "stopped_by": charged and charged.stopped_by}


def _order_key(order_id: int, *args: Any, **kwargs: Any) -> str:
    return f"order-{order_id}"


@shared_task
@pooled("warehouse", idempotency_key=_order_key)
def ship_order(order_id: int, sleep: float = 0.0) -> int:
    """Idempotent per order: a second submit for an unfinished order returns the first."""
    time.sleep(sleep)
    return order_id


@shared_task
@pooled("warehouse", concurrency_policy="skip")
def skip_job(sleep: float = 0.0) -> float:
    """A job that is not queued again while one instance waits or runs."""
    time.sleep(sleep)
    return time.time()


@shared_task
@pooled("warehouse", concurrency_policy="forbid")
def forbid_job(n: int = 0) -> int:
    """A job whose next instance waits (ineligible head) until the previous one finishes."""
    return n


@shared_task
@pooled("tenant:{tenant_id}", slots=1)
def tenant_job(tenant_id: str, n: int = 0) -> int:
    """A per-key pooled task: one pool per tenant (``POOLS['TEMPLATES']`` in the test)."""
    return n


@shared_task
@pooled("warehouse", concurrency_policy="replace", job_key=lambda tenant, **kw: tenant)
def replace_job(tenant: str) -> str:
    """Per tenant: a new entry supersedes the tenant's older waiting entries."""
    return tenant


@shared_task(bind=True)
@pooled("warehouse", job_key=lambda mode, **kw: "retrying")
def retrying_job(self: Task, mode: str) -> str:
    """``retry``: schedules its retry a minute ahead (it waits, delayed); ``ok``: succeeds."""
    if mode == "retry" and not self.request.retries:
        raise self.retry(countdown=60, max_retries=1)
    return mode


@shared_task(bind=True)
@pooled("warehouse", idempotency_key=lambda order_id, **kw: f"flaky-order-{order_id}")
def flaky_order(self: Task, order_id: int) -> int:
    """Idempotent per order; its first attempt retries (the retry keeps the key)."""
    if not self.request.retries:
        raise self.retry(countdown=3, max_retries=1)
    return order_id


@shared_task
@pooled({"global-api": 1, "tenant:{tenant_id}": 1})
def tenant_call(tenant_id: str, n: int = 0) -> int:
    """A global pool plus a per-tenant pool, acquired together."""
    return n


# --------------------------------------------------------------------------- workflow caps
#: Pool of the run-cap tests (made by the tests): large, so only the run cap binds.
BULK_POOL = "bulk"


@shared_task
@pooled(max_running=3)
def capped_span(i: int, sleep: float = 0.05) -> dict:
    """A task cap alone: at most 3 calls admitted at once, no named pool."""
    return _span(i, sleep)


@shared_task
@pooled("warehouse", max_running=1)
def capped_add(x: int, y: int) -> int:
    """A task cap of 1 composed with the named pool ``warehouse``."""
    return x + y


@shared_task
@pooled(BULK_POOL)
def run_member(i: int, sleep: float = 0.01, spawn: bool = False) -> dict:
    """A workflow member; with ``spawn`` it starts a child task (same root id) first."""
    child = run_member.delay(10_000 + i, sleep) if spawn else None
    return {**_span(i, sleep), "child": child.id if child else None}


@shared_task
@pooled("tenants", fairness_key=lambda tenant_id, *args, **kwargs: tenant_id)
def per_tenant(tenant_id: int, n: int = 0) -> int:
    """Fair to its first argument (strategy ``fair`` pools: one tenant per round)."""
    return n


@shared_task
@pooled({"warehouse": 1, "partner-api": 1})
def both_pools(x: int) -> int:
    """One slot of ``warehouse`` and one of ``partner-api`` (the fan-out tests)."""
    return x


@shared_task
@pooled(
    "warehouse", slots=1, debounce=1.5, debounce_key=lambda path, tenant, x: f"refresh-{tenant}"
)
def debounced_refresh(path: str, tenant: str, x: int) -> dict:
    """Debounced by tenant (docs/howto/debounce.md): append one line per body run to ``path``
    (the independent log of runs) and return what the body got; a negative ``x`` fails."""
    with open(path, "a") as out:
        out.write(json.dumps({"tenant": tenant, "x": x, "pid": os.getpid()}) + "\n")
    if x < 0:
        raise ValueError(f"refused x={x}")
    return {"tenant": tenant, "x": x}
