"""The demo's traffic: a first burst of pooled calls, then a steady trickle that keeps
every pool contended for as long as the demo runs.

The trickle is fed back from the pools themselves: each tick it tops up a pool's line to
a few waiting entries (one call per pool and tick at most), so the pools stay busy on a
slow machine without the lines growing on a fast one. One workflow run with a run cap
is always in progress; when it ends, the next starts.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from celery import chain, chord
from celery.utils import uuid

import pools
from demo import tasks

#: Waiting entries the trickle keeps in each named pool's line.
TARGETS = {"warehouse": 3, "partner-api": 2, "reports": 3}
#: Tasks of the workflow run, and how many of them may be admitted at once.
RUN_SIZE = 6
RUN_CAP = 2

URGENT = {"pool_options": {"priority": 20}}  # a per-call priority: ahead of other reports

Call = tuple[Any, tuple[Any, ...], dict[str, Any]]


def burst_plan(count: int) -> list[Call]:
    """``count`` calls in a mix that makes the pools contend at once."""
    plan: list[Callable[[int], Call]] = [
        lambda i: (tasks.load_table, (f"table_{i}",), {}),
        lambda i: (tasks.render_report, (i,), {}),
        lambda i: (tasks.sync_partner, (1000 + i,), {}),
        lambda i: (tasks.export, (f"2025-01-{i % 28 + 1:02d}",), {}),
        lambda i: (tasks.load_table, (f"table_{i}",), {}),
        lambda i: (tasks.render_report, (i,), URGENT),
    ]
    return [plan[i % len(plan)](i) for i in range(count)]


def send(calls: list[Call], mix: Counter[str]) -> list[str]:
    """Call each task; returns the keys (Celery task ids)."""
    keys = []
    for task, args, options in calls:
        keys.append(task.apply_async(args, **options).id)
        mix[task.__name__] += 1
    return keys


def _warehouse_calls() -> Iterator[Call]:
    """Warehouse work in turn: loads, a 2-slot export, a multi-pool partner sync."""
    for i in itertools.count():
        yield (tasks.load_table, (f"table_{i}",), {})
        yield (tasks.sync_partner, (2000 + i,), {})
        yield (tasks.export, (f"2025-02-{i % 28 + 1:02d}",), {})
        yield (tasks.load_table, (f"table_{i}b",), {})


def _report_calls() -> Iterator[Call]:
    """Reports: plain, urgent (priority 20), and one due in 10 s (``countdown``)."""
    for i in itertools.count():
        yield (tasks.render_report, (i,), {})
        yield (tasks.render_report, (i,), URGENT)
        yield (tasks.render_report, (i,), {})
        yield (tasks.render_report, (i,), {"countdown": 10})


def start_run(n: int) -> str:
    """A nightly-style workflow run: a load, then a chord of loads, syncs and an export
    ending in a report, at most :data:`RUN_CAP` of its tasks admitted at once. Returns
    its root id (the run panel's address)."""
    header = [
        tasks.sync_partner.si(3000 + n * 10 + i) if i % 3 == 2 else tasks.load_table.si(f"n{n}_{i}")
        for i in range(RUN_SIZE)
    ]
    workflow = chain(tasks.load_table.si(f"n{n}_staging"), chord(header, tasks.summarize.s(n)))
    root_id = f"nightly-{n + 1}-{uuid()[:6]}"  # a short, readable run id (any string does)
    pools.limit_run(workflow, max_running=RUN_CAP, root_id=root_id)
    return root_id


class Trickle:
    """Tops the pools' lines up, one call per pool and tick, and keeps a run going."""

    def __init__(self) -> None:
        self.mix: Counter[str] = Counter()
        self.keys: list[str] = []
        self.runs: list[str] = []
        self._feeds: dict[str, Iterator[Call]] = {
            "warehouse": _warehouse_calls(),
            "partner-api": ((tasks.sync_partner, (5000 + i,), {}) for i in itertools.count()),
            "reports": _report_calls(),
        }

    def summary(self) -> str:
        """``41 calls (12 load_table, ...) and 3 workflow runs``."""
        mix = ", ".join(f"{n} {name}" for name, n in sorted(self.mix.items()))
        return f"{len(self.keys)} calls ({mix}) and {len(self.runs)} workflow runs"

    def tick(self, waiting: dict[str, int]) -> None:
        """One step: ``waiting`` is each pool's waiting count now."""
        for name, target in TARGETS.items():
            if waiting.get(name, 0) < target:
                self.keys += send([next(self._feeds[name])], self.mix)
        if not self.runs or self.run_done(self.runs[-1]):
            self.runs.append(start_run(len(self.runs)))

    @staticmethod
    def run_done(root_id: str) -> bool:
        """Every task of the run has finished: its summary ran, or a task of it failed."""
        from pools.models import QueueEntry
        from pools.states import TERMINAL_STATES

        rows = list(QueueEntry.objects.filter(root_id=root_id).values_list("task_name", "state"))
        if any(state not in TERMINAL_STATES for _, state in rows):
            return False
        return any(name == tasks.summarize.name or state != "succeeded" for name, state in rows)
