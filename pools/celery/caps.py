"""Workflow caps: a run cap over every task of a Celery workflow, and a task cap.

A **run cap** (:func:`limit_run`) admits at most N pooled tasks of one workflow at once:
every task sharing the workflow's ``root_id``, including tasks started by tasks. It is
the pool ``run-cap:<root id>``, made before the workflow is sent; the gate adds it to the
demand of every pooled call whose ``root_id`` names it. A **task cap**
(``@pooled(max_running=N)``) is the pool ``task-cap:<task name>``, one slot per call.

Both are ordinary pools in the demand, so admission stays atomic over all of an entry's
gates (run cap, task cap, named pools), and ``explain`` reports them first, in that
order, as ``run_cap`` / ``task_cap`` when they are full. Cap pools carry a ``template``
marker: the sweep deletes them once idle for ``POOLS['TEMPLATE_IDLE_SECONDS']``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from celery.utils import uuid

from pools.core import budgets, definitions
from pools.exceptions import PoolConfigurationError
from pools.models import Pool
from pools.pool_names import RUN_CAP_PREFIX, TASK_CAP_PREFIX, cap_pool_name
from pools.specs import Budget, PoolSpec, positive_int

#: ``template`` marker of run-cap and task-cap pools (shown in the admin; idle retirement).
RUN_CAP_TEMPLATE = RUN_CAP_PREFIX + "{root_id}"
TASK_CAP_TEMPLATE = TASK_CAP_PREFIX + "{task}"

#: Root ids known to have no run cap, per process (a run cap is made before its workflow
#: is sent, so "none" stays true): spares the look-up for the other tasks of a workflow.
_UNCAPPED: OrderedDict[str, None] = OrderedDict()
_UNCAPPED_MAX = 10_000
#: Task caps this process has made sure of: ``{pool: (slots, rate)}``.
_ENSURED: dict[str, tuple[int, str]] = {}


def limit_run(
    signature: Any,
    *,
    max_running: int | None = None,
    budget: Mapping[str, Any] | Budget | None = None,
    **options: Any,
) -> Any:
    """Send a workflow (a signature, chain, group or chord) as one run with a run cap, a
    budget, or both; returns what ``apply_async`` returns.

    ``max_running=N``: at most N of its pooled tasks admitted at once, across every worker
    (``pools.limit_run(group(resize.s(i) for i in range(500)), max_running=4)``).
    ``budget={"cost": 10, "tokens": 5000, "seconds": 600}`` (any subset): what the run may
    spend (:mod:`pools.core.budgets`). The workflow's ``root_id`` (given in ``options``,
    else a new id) names the run; tasks the workflow's tasks start inherit it, as Celery
    passes ``root_id`` down. Only pooled tasks (``@pooled``, or the default pool when it is
    on) are held back. Both are written (committed) before anything is sent. Raises
    :class:`~pools.exceptions.PoolConfigurationError` for a bad value, or when neither is
    given.
    """
    if max_running is None and budget is None:
        raise PoolConfigurationError(
            "limit_run() needs max_running=N (a run cap), budget={...} (a run budget), or both."
        )
    slots = None if max_running is None else positive_int(max_running, what="max_running")
    limits = None if budget is None else Budget.from_mapping(budget)
    root_id = str(options.pop("root_id", None) or signature.options.get("root_id") or uuid())
    if limits is not None:
        budgets.open_run(root_id, limits)
    if slots is not None:
        definitions.ensure_cap_pool(
            cap_pool_name(RUN_CAP_PREFIX, root_id), slots, template=RUN_CAP_TEMPLATE
        )
        _UNCAPPED.pop(root_id, None)
    return signature.apply_async(root_id=root_id, **options)


def with_run_cap(spec: PoolSpec, root_id: str, task_id: str) -> PoolSpec:
    """``spec`` plus the run cap of workflow ``root_id``, if it has one.

    No look-up for a call that is its own root (no workflow, or the first task of one that
    :func:`limit_run` did not send: it gives the workflow a root id of its own), nor for a
    root already known uncapped in this process; else one indexed read of the pool.
    """
    if not root_id or root_id == task_id or root_id in _UNCAPPED:
        return spec
    name = cap_pool_name(RUN_CAP_PREFIX, root_id)
    if not _is_cap(name):
        _remember_uncapped(root_id)
        return spec
    return spec.with_run_cap(name)


def _is_cap(name: str) -> bool:
    return Pool.objects.filter(name=name).exists()


def _remember_uncapped(root_id: str) -> None:
    _UNCAPPED[root_id] = None
    if len(_UNCAPPED) > _UNCAPPED_MAX:
        _UNCAPPED.popitem(last=False)


def ensure_caps(spec: PoolSpec, *, again: bool = False) -> None:
    """Make the task-cap pools of ``spec`` exist with their capacity (once per process,
    or ``again`` after admission found one gone)."""
    for name, slots in spec.caps.items():
        rate = spec.cap_rates.get(name, "")
        if again or _ENSURED.get(name) != (slots, rate):
            definitions.ensure_cap_pool(name, slots, template=TASK_CAP_TEMPLATE, rate=rate)
            _ENSURED[name] = (slots, rate)
