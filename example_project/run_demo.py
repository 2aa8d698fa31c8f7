#!/usr/bin/env python
"""The django-celery-pools demo (``make demo``).

Migrates, creates a demo superuser, starts a Celery prefork worker and the
Django development server, submits a burst of pooled tasks that contend for
their pools and prints the pools live until the burst has drained. Then a steady
trickle of calls (and one workflow run with a run cap at a time) keeps the pools
contended until Ctrl-C, or for ``--seconds N``, after which the demo drains and exits.

    .venv/bin/python example_project/run_demo.py [--tasks N] [--seconds N] [--no-serve]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from demo import traffic

    from pools.core.snapshots import PoolSnapshot

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")

from pools.celery import processes  # noqa: E402  (imports neither Django nor Celery)

USERNAME = PASSWORD = "demo"
CONCURRENCY = 8  # prefork processes of the demo worker (the bodies only sleep)
#: A warm shutdown may take this long before the worker's process group is killed.
STOP_TIMEOUT = 20.0
TICK = 0.5  # seconds between two live summaries, and between two trickle steps
SAMPLE_EVERY = 5.0  # seconds between two summary lines during the trickle
TERMINAL = ("succeeded", "failed", "cancelled", "expired", "rejected", "superseded", "retried")


class Stop(Exception):
    """Raised by the SIGINT / SIGTERM handler to leave whatever the demo is doing."""


def _on_signal(signum: int, frame: object) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # until stop() installs its own handler
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Stop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=30, help="tasks in the burst (default 30)")
    parser.add_argument(
        "--no-serve", action="store_true", help="no web server; exit once the work has drained"
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="trickle for this long, then drain and exit (default: until Ctrl-C; "
        "with --no-serve and no --seconds, no trickle)",
    )
    parser.add_argument("--timeout", type=float, default=None, help="give up draining after (s)")
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]

    import django

    django.setup()
    from django.conf import settings

    var = Path(settings.VAR_DIR)
    children: list[processes.Process] = []
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        prepare_database()
        print(
            f"Database: {describe_db(settings)}   Broker: {settings.CELERY_BROKER_URL}   "
            f"Results: {settings.CELERY_RESULT_BACKEND}"
        )
        children.append(start_worker(var))
        wait_for_worker(children[0])
        admin_url = None
        if not args.no_serve:
            port = free_port(8000)
            children.append(
                processes.start_process(
                    [sys.executable, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload"],
                    log=var / "server.log",
                    name="server",
                    cwd=HERE,
                )
            )
            wait_for_port(port)
            admin_url = f"http://127.0.0.1:{port}/admin/"
            print(f"Admin:    {admin_url}  (login {USERNAME} / {PASSWORD})")

        keys = submit(args.tasks)
        drained = watch(keys, timeout=args.timeout or 60 + args.tasks)
        check_worker_log(var / "worker.log")
        if args.no_serve and args.seconds is None:
            return 0 if drained else 1

        from demo import traffic

        trickle = traffic.Trickle()
        trickle.tick(waiting_counts())  # the first workflow run: its panel is printed below
        if admin_url:
            print(f"\nAdmin:    {admin_url}  (login {USERNAME} / {PASSWORD})")
            print(
                "          Resource pools, queue entries and the event log are under "
                "'Resource pools'."
            )
            for label, url in surface_urls(admin_url, trickle.runs[0]):
                print(f"{label + ':':<10}{url}")
            print("Docs:     docs/ in the repository (make docs builds them into .site/)")
            print(f"Logs:     {var / 'worker.log'}, {var / 'server.log'}")
        until = "until Ctrl-C" if args.seconds is None else f"for {args.seconds:.0f} s"
        print(
            f"\nTrickle:  calls keep coming {until}, a workflow run (run cap "
            f"{traffic.RUN_CAP}) at a time; a line every {SAMPLE_EVERY:.0f} s:"
        )
        if not run_trickle(trickle, children, args.seconds):
            print("A child process exited unexpectedly; see the logs above.", file=sys.stderr)
            return 1
        print(f"\nTrickle stopped: {trickle.summary()}. Draining ...")
        drained = drain(trickle, timeout=args.timeout or 120)
        check_worker_log(var / "worker.log")
        return 0 if drained else 1
    except Stop:
        print(
            "\nStopping the worker (warm shutdown: running tasks finish first) and the server;"
            " Ctrl-C again to kill them ..."
        )
        stop(children)
        print("Stopped.")
        return 0
    except RuntimeError as exc:  # a child did not start: say why, without a traceback
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    finally:
        stop(children)


def prepare_database() -> None:
    """Apply migrations (which also syncs POOLS['DEFINITIONS']) and create the demo user."""
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    user_model = get_user_model()
    if not user_model.objects.filter(username=USERNAME).exists():
        user_model.objects.create_superuser(USERNAME, "demo@example.com", PASSWORD)


def describe_db(settings: object) -> str:
    db = settings.DATABASES["default"]  # type: ignore[attr-defined]
    return f"{db['ENGINE'].rsplit('.', 1)[-1]} {db.get('NAME')}"


def start_worker(var: Path) -> processes.Process:
    """The demo's prefork worker, in its own session (Ctrl-C reaches only us), log in var/.

    Embedded celery-beat (``beat=True``) runs the pools sweep, the safety net for lapsed
    leases.
    """
    return processes.start_worker(
        "example_project",
        node="demo",
        log=var / "worker.log",
        concurrency=CONCURRENCY,
        loglevel="INFO",
        heartbeat=False,
        beat=True,
        cwd=HERE,
    )


def stop(children: list[processes.Process]) -> None:
    """SIGTERM each child (Celery does a warm shutdown), then SIGKILL what is left."""

    def force(signum: int, frame: object) -> None:  # a second Ctrl-C does not wait
        processes.kill(children)

    signal.signal(signal.SIGINT, force)
    signal.signal(signal.SIGTERM, force)
    processes.stop(children, STOP_TIMEOUT)


def free_port(preferred: int) -> int:
    for port in (preferred, 0):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise RuntimeError("no free port")


def wait_for_port(port: int, timeout: float = 20) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the development server did not start on port {port}")


def wait_for_worker(worker: processes.Process, timeout: float = 60) -> None:
    """Wait until the worker logs that it is ready, so the burst starts running at once."""
    started = time.monotonic()
    # The readiness marker in its log (INFO level): no broker round trip needed.
    try:
        processes.wait_ready([worker], timeout=timeout)
    except processes.ProcessStartError as exc:
        raise RuntimeError(f"the Celery worker did not start: {exc}") from None
    print(
        f"Worker:   {CONCURRENCY} prefork processes ready in {time.monotonic() - started:.1f} s  (log: {worker.log})"
    )


def submit(count: int) -> list[str]:
    """Submit ``count`` pooled tasks in a mix that makes the pools contend."""
    from demo import traffic

    started = time.monotonic()
    mix: Counter[str] = Counter()
    keys = traffic.send(traffic.burst_plan(count), mix)
    print(
        f"\nSubmitted {count} tasks in {time.monotonic() - started:.2f} s: "
        + ", ".join(f"{n} {name}" for name, n in sorted(mix.items()))
    )
    return keys


def watch(keys: list[str], timeout: float) -> bool:
    """Print the pools every TICK seconds until every submitted entry has finished."""
    from celery import current_app

    from pools.core.snapshots import snapshot_all
    from pools.models import QueueEntry

    started = time.monotonic()
    while True:
        states = Counter(QueueEntry.objects.filter(key__in=keys).values_list("state", flat=True))
        elapsed = time.monotonic() - started
        print(f"\n{elapsed:5.1f} s")
        for snap in snapshot_all():
            running = sum(1 for h in snap.holders if h.state == "running")
            bar = "#" * min(snap.held, snap.slots) + "." * snap.free
            print(
                f"  {snap.name:<12} [{bar}] {snap.held}/{snap.slots} held  {snap.free} free  "
                f"{snap.waiting:3} waiting  {running} running{describe_head(snap)}"
            )
        finished = sum(states[s] for s in TERMINAL)
        print(f"  {states['succeeded']}/{len(keys)} succeeded, {states['failed']} failed")
        if finished >= len(keys):
            break
        if elapsed > timeout:
            print(
                f"\nGave up after {timeout:.0f} s: {len(keys) - finished} entries unfinished "
                f"({dict(states)})."
            )
            return False
        time.sleep(TICK)

    stored = sum(current_app.AsyncResult(key).successful() for key in keys)
    other = finished - states["succeeded"] - states["failed"]
    print(
        f"\nDrained in {time.monotonic() - started:.1f} s: {states['succeeded']} succeeded, "
        f"{states['failed']} failed, {other} other; {stored}/{len(keys)} results stored "
        f"in the result backend."
    )
    return states["succeeded"] == len(keys) and stored == len(keys)


def surface_urls(admin_url: str, root_id: str) -> list[tuple[str, str]]:
    """The operator's pages: the card, a workflow run's panel, a pool's page, the API."""
    site = admin_url.removesuffix("admin/")
    return [
        ("Card", f"{admin_url}  (the Resource pools card, top of the admin index)"),
        ("Run", f"{admin_url}pools/queueentry/run/{root_id}/  (a workflow run, capped)"),
        ("Pool", f"{admin_url}pools/pool/occupancy/warehouse/  (a pool's timeline)"),
        ("API", f"{site}api/pools/  (REST, same login; OpenAPI UI at {site}api/docs/)"),
    ]


def waiting_counts() -> dict[str, int]:
    """Each pool's waiting count now."""
    from pools.core.snapshots import snapshot_all

    return {snap.name: snap.waiting for snap in snapshot_all()}


def run_trickle(
    trickle: traffic.Trickle, children: list[processes.Process], seconds: float | None
) -> bool:
    """Feed the pools every TICK, print a summary line every SAMPLE_EVERY seconds; False
    when a child process died."""
    from pools.core.snapshots import snapshot_all

    started = time.monotonic()
    next_sample = started
    while seconds is None or time.monotonic() - started < seconds:
        if not all(child.alive() for child in children):
            return False
        snaps = snapshot_all()
        trickle.tick({snap.name: snap.waiting for snap in snaps})
        if time.monotonic() >= next_sample:
            next_sample += SAMPLE_EVERY
            print(sample_line(time.monotonic() - started, snaps))
        time.sleep(TICK)
    return True


def drain(trickle: traffic.Trickle, timeout: float) -> bool:
    """Wait until the trickle's calls and every task of its runs have finished; True when
    all of them succeeded."""
    from django.db.models import Q

    from pools.models import QueueEntry
    from pools.states import TERMINAL_STATES

    started = time.monotonic()
    ours = Q(key__in=trickle.keys) | Q(root_id__in=trickle.runs)
    while True:
        states = Counter(QueueEntry.objects.filter(ours).values_list("state", flat=True))
        unfinished = sum(n for state, n in states.items() if state not in TERMINAL_STATES)
        if not unfinished and all(trickle.run_done(root) for root in trickle.runs):
            break
        if time.monotonic() - started > timeout:
            print(f"Gave up after {timeout:.0f} s: {unfinished} entries unfinished.")
            return False
        time.sleep(TICK)
    other = sum(states.values()) - states["succeeded"] - states["failed"]
    print(
        f"Trickle drained in {time.monotonic() - started:.1f} s: {states['succeeded']} "
        f"succeeded, {states['failed']} failed, {other} other."
    )
    return states["succeeded"] == sum(states.values())


def sample_line(elapsed: float, snaps: list[PoolSnapshot]) -> str:
    """``[ 10 s] warehouse 4/4 held 3 waiting | ...``: one line for every pool in use."""
    parts = []
    for snap in snaps:
        if snap.name.startswith("run-cap:") and not (snap.held or snap.waiting):
            continue  # a finished run's cap, until the sweep retires it
        name = snap.name if len(snap.name) <= 24 else snap.name[:24] + "…"
        parts.append(f"{name} {snap.held}/{snap.slots} held {snap.waiting} waiting")
    return f"  [{elapsed:4.0f} s] " + " | ".join(parts)


def describe_head(snap: PoolSnapshot) -> str:
    """``next: export (priority 10, 2 slots)``: the first entry in the pool's line."""
    if not snap.head:
        return ""
    head = snap.head[0]
    name = head.task_name.rsplit(".", 1)[-1]
    return f"  next: {name} (priority {head.priority}, {head.slots} slot{'s' * (head.slots > 1)})"


def check_worker_log(path: Path) -> None:
    """Point at errors the worker logged (e.g. 'database is locked')."""
    text = path.read_text(errors="replace")
    problems = [
        line
        for line in text.splitlines()
        if "ERROR" in line or "Traceback" in line or "database is locked" in line
    ]
    if problems:
        print(
            f"Warning: the worker logged {len(problems)} error line(s), first: {problems[0]!r}; "
            f"see {path}"
        )


if __name__ == "__main__":
    sys.exit(main())
