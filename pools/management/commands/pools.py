"""``manage.py pools``: list, inspect, sync, drain, pause, resume, cancel, sweep, bench."""

from __future__ import annotations

import importlib
from argparse import ArgumentParser, Namespace
from types import ModuleType
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from pools import __version__
from pools.celery import beat
from pools.core import admission, capacity, rates, settings_sync, snapshots, sweeps
from pools.core.snapshots import PoolSnapshot
from pools.exceptions import PoolError


def bar(held: int, slots: int, width: int = 20) -> str:
    """A text occupancy bar such as ``[######--------------]``."""
    filled = round(width * min(held, slots) / slots) if slots else 0
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def summary_line(s: PoolSnapshot) -> str:
    """One line per pool: occupancy bar, held/slots, free, waiting."""
    flag = " (paused)" if s.paused else ""
    if s.draining:
        flag += f" (draining to {s.slots})"
    if s.retiring:
        flag += " (retiring)"
    if s.strategy != "priority" or s.aging_seconds is not None:
        aging = f", aging {s.aging_seconds}s" if s.aging_seconds is not None else ""
        flag += f" ({s.strategy}{aging})"
    if s.rate:
        flag += f" (rate {', '.join(s.rate)})"
    for label in s.override_labels:
        flag += f" ({label})"
    cap = s.capacity or s.slots
    if cap >= rates.UNLIMITED_SLOTS:  # a rate alone: starts are limited, not slots
        return f"{s.name:<20} {s.held} held (no slot limit), {s.waiting} waiting{flag}"
    return (
        f"{s.name:<20} {bar(s.held, cap)} {s.held}/{cap} held, {s.free} free, "
        f"{s.waiting} waiting{flag}"
    )


#: The benchmark's package: in a checkout of the repository, not in the wheel.
BENCH_PACKAGE = "pools.bench"


def bench_missing(version: str) -> str:
    """What ``pools bench`` says when the benchmark is not installed (the wheel lacks it)."""
    return (
        f"The benchmark is not part of the installed package (django-celery-pools {version}): "
        f"it runs from a checkout of the repository. Clone the django-celery-pools repository, "
        f"check out the tag v{version}, run 'make install' there, then run the command that "
        f"docs/benchmarks.md gives under 'Run it' (python example_project/manage.py pools "
        f"bench ...)."
    )


def load_bench() -> ModuleType:
    """The benchmark's command line (``pools.bench.cli``); a :class:`CommandError` saying how
    to get it when the package is not installed."""
    try:
        return importlib.import_module(f"{BENCH_PACKAGE}.cli")
    except ModuleNotFoundError as exc:
        name = exc.name or ""
        if name != BENCH_PACKAGE and not name.startswith(f"{BENCH_PACKAGE}."):
            raise  # one of the benchmark's own dependencies: its message says which
        raise CommandError(bench_missing(__version__)) from exc


class Command(BaseCommand):
    help = (
        "Inspect and manage resource pools: list, inspect NAME, sync, drain NAME, pause NAME, "
        "resume NAME, sweep, cancel KEY, bench."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        sub.add_parser("list", help="One line per pool: capacity, held, waiting.")
        inspect = sub.add_parser("inspect", help="Holders and the head of a pool's line.")
        inspect.add_argument("name")
        inspect.add_argument("--head", type=int, default=10, help="Waiting entries to show.")
        sub.add_parser("sync", help="Create/update pools from POOLS['DEFINITIONS'].")
        drain = sub.add_parser("drain", help="Progress of a pool's capacity change.")
        drain.add_argument("name")
        pause = sub.add_parser("pause", help="Pause a pool: it admits nothing, entries wait.")
        pause.add_argument("name")
        resume = sub.add_parser("resume", help="Resume a paused pool.")
        resume.add_argument("name")
        cancel = sub.add_parser("cancel", help="Cancel a waiting entry by key (task id).")
        cancel.add_argument("key")
        sub.add_parser("sweep", help="Run one sweep pass (lapsed leases, deadlines, admission).")
        # The benchmark is in a checkout of the repository, not in the wheel: its own parser
        # reads these arguments, so pools.bench is imported only when it runs ('pools bench
        # --help' lists them, or says how to get it).
        bench = sub.add_parser(
            "bench",
            help="Benchmark pools against plain Celery and the Redis-lock recipe "
            "(from a checkout of the repository; starts its own workers; see "
            "docs/benchmarks.md).",
            add_help=False,
        )
        bench.set_defaults(bench_args=[])

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parse_known = parser.parse_known_args

        def parse_args(args: Any = None, namespace: Any = None) -> Namespace:
            # What follows 'bench' is the benchmark's own (see do_bench).
            values: Namespace
            values, rest = parse_known(args, namespace)
            if rest and getattr(values, "action", None) != "bench":
                parser.error(f"unrecognized arguments: {' '.join(rest)}")
            if getattr(values, "action", None) == "bench":
                values.bench_args = rest
            return values

        parser.parse_args = parse_args  # type: ignore[method-assign,assignment]
        return parser

    def handle(self, *args: Any, action: str, **options: Any) -> None:
        try:
            getattr(self, f"do_{action}")(**options)
        except PoolError as exc:
            raise CommandError(str(exc)) from exc

    def do_list(self, **options: Any) -> None:
        snaps = snapshots.snapshot_all(head=0)
        if not snaps:
            self.stdout.write("No pools. Define them in POOLS['DEFINITIONS'] and run 'pools sync'.")
        for s in snaps:
            self.stdout.write(summary_line(s))
        overdue = beat.sweep_overdue()
        if overdue:
            self.stdout.write(f"warning: {overdue} (see 'manage.py check --database default')")

    def do_inspect(self, name: str, head: int, **options: Any) -> None:
        s = snapshots.snapshot(name, head=head)
        self.stdout.write(summary_line(s))
        self.stdout.write("holding:" if s.holders else "holding: nobody")
        for h in s.holders:
            self.stdout.write(
                f"  #{h.queue_id} {h.task_name} {h.state} slots={h.slots} worker={h.worker or '-'} "
                f"lease until {h.lease_expires_at:%H:%M:%S}"
                if h.lease_expires_at
                else ""
            )
        self.stdout.write("waiting:" if s.head else "waiting: nobody")
        for w in s.head:
            deadline = f" deadline {w.deadline:%Y-%m-%d %H:%M:%S}" if w.deadline else ""
            self.stdout.write(
                f"  {w.position}. #{w.queue_id} {w.task_name} priority={w.priority} "
                f"slots={w.slots}{deadline}{f' key={w.fairness_key}' if w.fairness_key else ''}"
            )

    def do_sync(self, **options: Any) -> None:
        report = settings_sync.sync()
        self.stdout.write(
            f"created: {', '.join(report.created) or '-'}; updated: "
            f"{', '.join(report.updated) or '-'}; unchanged: {', '.join(report.unchanged) or '-'}"
        )
        for name in report.draining:
            self.stdout.write(
                f"draining: {name} keeps its old capacity until the entries queued before the "
                f"change are admitted ('manage.py pools drain {name}')"
            )
        if report.per_key:
            self.stdout.write(
                f"per-key pools given their template's values: {', '.join(report.per_key)}"
            )
        if report.deleted:
            self.stdout.write(f"deleted (removed from settings): {', '.join(report.deleted)}")
        for name, active in report.retiring.items():
            self.stdout.write(
                f"retiring: {name} was removed from settings but has {active} unfinished "
                f"entr{'y' if active == 1 else 'ies'}; it is deleted once they finish"
            )

    def do_drain(self, name: str, **options: Any) -> None:
        d = capacity.drain_progress(name)
        if not d.draining:
            self.stdout.write(
                f"{name}: not draining; capacity {d.capacity}, {d.held} held, {d.left} waiting"
            )
            return
        self.stdout.write(
            f"{name}: draining from {d.capacity} to {d.slots} slot(s): {d.left} "
            f"entr{'y' if d.left == 1 else 'ies'} queued before the change left, {d.held} "
            f"slot(s) held; new submits are refused until the line is empty"
        )

    def do_pause(self, name: str, **options: Any) -> None:
        changed = capacity.set_paused(name, True)
        self.stdout.write(f"paused {name}" if changed else f"{name} was already paused")

    def do_resume(self, name: str, **options: Any) -> None:
        changed = capacity.set_paused(name, False)
        self.stdout.write(f"resumed {name}" if changed else f"{name} was not paused")

    def do_sweep(self, **options: Any) -> None:
        r = sweeps.sweep()
        cancelled = beat.cancel_stale_fires()  # periodic tasks changed behind the signals
        self.stdout.write(
            f"requeued {r.requeued}, expired {r.expired}, admitted {r.admitted}, pruned {r.pruned}"
            + (
                f", cancelled {cancelled} waiting fires of changed periodic tasks"
                if cancelled
                else ""
            )
        )

    def do_cancel(self, key: str, **options: Any) -> None:
        entry = admission.cancel(key)
        self.stdout.write(f"cancelled #{entry.queue_id} {entry.task_name} ({key})")

    def do_bench(self, bench_args: list[str], **options: Any) -> None:
        bench_cli = load_bench()
        parser = ArgumentParser(prog="manage.py pools bench")
        bench_cli.add_arguments(parser)
        values = vars(parser.parse_args(bench_args))
        try:
            results = bench_cli.run(values, self.stdout)
        except RuntimeError as exc:  # a worker that did not start, no result backend, ...
            raise CommandError(str(exc)) from exc
        failed = [k for k, v in results.items() if isinstance(v, dict) and "error" in v]
        if failed:
            raise CommandError(f"workload(s) failed: {', '.join(failed)} (see the output above)")
