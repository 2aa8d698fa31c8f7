"""Silent network partitions on real workers: a black-holed PostgreSQL or broker socket.

One worker, ``w1``, reaches PostgreSQL (or the broker) through a loopback proxy
(:class:`tests.support.blackhole.BlackholeProxy`) that stops forwarding mid-body: no RST,
no FIN, the sockets just go silent, as behind a dead switch. ``w2`` and beat are connected
directly. Lease 5 s (heartbeat and fence margin 1.67 s), sweep 1 s, a 1-slot pool, a 25 s
body that writes a line every 0.25 s (``tests.testapp.fault_tasks.ticking``).

Every body attempt is counted alive from its start to its **last sign of life** (its last
line), not to its lease's end. The test process polls the entry's lease in the database,
so the lease end of ``w1``'s claim is known as PostgreSQL saw it.

The sabotage twin starts ``w1`` with the keeper's watchdog switched off
(``POOLS_TEST_SABOTAGE=no-fence-watchdog``, see ``tests/celery_app.py``): the body then
outlives its lease, as reported before the watchdog existed, so the main test cannot pass
without it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
from django.conf import settings as django_settings
from django.db import connection
from pytest_django import Settings

from pools.models import Pool, QueueEntry
from pools.states import EntryState
from tests.acceptance import faults_support
from tests.acceptance.conftest import WORKER_TEST_MARKS, StartWorkers, Worker
from tests.acceptance.faults_support import Beat, max_overlap, read_notes, wait_for
from tests.support.blackhole import BlackholeProxy
from tests.testapp.fault_tasks import NET_POOL, ticking

pytestmark = WORKER_TEST_MARKS

shared_dir = faults_support.shared_dir
celery_beat = faults_support.celery_beat

LEASE = 5.0
SWEEP = 1.0
BODY = 25.0
#: How long the broker partition lasts (longer than a lease).
BROKER_CUT = 8.0
TIMEOUT = 120.0


@pytest.fixture
def lease5(monkeypatch: pytest.MonkeyPatch, settings: Settings) -> None:
    """LEASE_SECONDS=5, SWEEP_SECONDS=1 here and in workers and beat started later."""
    monkeypatch.setenv("POOLS_LEASE_SECONDS", str(LEASE))
    monkeypatch.setenv("POOLS_SWEEP_SECONDS", str(SWEEP))
    monkeypatch.delenv("POOLS_HEARTBEAT_SECONDS", raising=False)
    pools = {k: v for k, v in settings.POOLS.items() if k != "HEARTBEAT_SECONDS"}
    settings.POOLS = {**pools, "LEASE_SECONDS": LEASE, "SWEEP_SECONDS": SWEEP}


def attempts(notes: list[dict[str, Any]]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Per attempt (token, pid): host, start, last sign of life, how it ended."""
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for n in notes:
        a = out.setdefault(
            (n["token"], n["pid"]),
            {"host": n["hostname"], "token": n["token"], "start": n["t"], "events": []},
        )
        a["last"] = n["t"]
        a["events"].append(n["event"])
    return out


def start_behind(
    kind: str,
    proxy: BlackholeProxy,
    celery_workers: StartWorkers,
    monkeypatch: pytest.MonkeyPatch,
    settings: Settings,
    sabotage: bool,
) -> Worker:
    """Start ``w1`` (one process) with its PostgreSQL or broker traffic through ``proxy``."""
    broker = django_settings.CELERY_BROKER_URL
    with monkeypatch.context() as m:
        if kind == "db":
            m.setenv("POOLS_PG_PORT", str(proxy.port))
        else:
            parts = urlsplit(broker)
            userinfo = parts.netloc.rpartition("@")[0]  # amqp://guest:guest@...: kept
            netloc = f"{userinfo}@" if userinfo else ""
            settings.CELERY_BROKER_URL = urlunsplit(
                parts._replace(netloc=f"{netloc}{parts.hostname}:{proxy.port}")
            )
        if sabotage:
            m.setenv("POOLS_TEST_SABOTAGE", "no-fence-watchdog")
        try:
            (w1,) = celery_workers(count=1, concurrency=1, allow_errors=True)
        finally:
            settings.CELERY_BROKER_URL = broker
    return w1


def run_partition(
    kind: str,
    *,
    sabotage: bool,
    celery_workers: StartWorkers,
    celery_beat: Callable[[], Beat],
    shared_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    settings: Settings,
) -> dict[str, Any]:
    """Run one partition scenario; returns what happened (attempts, times, lease end)."""
    if kind == "db":
        target = ("127.0.0.1", int(connection.settings_dict["PORT"] or 5432))
    else:
        parts = urlsplit(django_settings.CELERY_BROKER_URL)
        default_port = 5672 if parts.scheme.startswith("amqp") else 6379
        target = (parts.hostname or "127.0.0.1", parts.port or default_port)
    Pool.objects.create(name=NET_POOL, slots=1)
    with BlackholeProxy(*target) as proxy:
        w1 = start_behind(kind, proxy, celery_workers, monkeypatch, settings, sabotage)
        assert proxy.accepted > 0, "w1 does not go through the proxy: the test would be vacuous"
        celery_beat()
        where = str(shared_dir)
        result = ticking.delay(where, BODY)

        def ticks_on(host: str, n: int) -> bool:
            notes = read_notes(shared_dir, "ticks")
            return sum(1 for x in notes if x["hostname"] == host and x["event"] == "tick") >= n

        wait_for(lambda: ticks_on(w1.name, 2), TIMEOUT, "the body to tick on w1", 0.05)
        (w2,) = celery_workers(count=1, concurrency=1)
        entry = QueueEntry.objects.get(key=result.id)
        time.sleep(1.0)  # a few more lines on w1, then the cut
        lease_end: float | None = None

        def watch_lease() -> float | None:
            row = QueueEntry.objects.filter(pk=entry.pk).values("token", "lease_expires_at")[0]
            if row["token"] == 1 and row["lease_expires_at"] is not None:
                return float(row["lease_expires_at"].timestamp())
            return None

        lease_end = watch_lease()
        cut_at = time.time()
        proxy.cut()
        healed_at: float | None = None
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            seen = watch_lease()
            if seen is not None:
                lease_end = seen
            tried = attempts(read_notes(shared_dir, "ticks"))
            rerun = [a for a in tried.values() if a["host"] == w2.name]
            ended = [a for a in tried.values() if "end" in a["events"]]
            if kind == "db" and rerun and healed_at is None:
                time.sleep(2.0)  # the partition heals a while after the re-run started
                proxy.heal()
                healed_at = time.time()
            if kind == "broker" and healed_at is None and time.time() > cut_at + BROKER_CUT:
                proxy.heal()
                healed_at = time.time()
            if ended and healed_at is not None:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"no body ended within {TIMEOUT:.0f}s of the cut")
        if proxy.is_cut:
            proxy.heal()
        value = result.get(timeout=TIMEOUT)
        wait_for(
            lambda: QueueEntry.objects.filter(pk=entry.pk, state=EntryState.SUCCEEDED).exists(),
            TIMEOUT,
            "the entry to settle as succeeded",
        )
    return {
        "w1": w1.name,
        "w2": w2.name,
        "cut_at": cut_at,
        "healed_at": healed_at,
        "lease_end": lease_end,
        "attempts": attempts(read_notes(shared_dir, "ticks")),
        "value": value,
    }


def test_partition__db_black_holed_mid_body_fences_before_the_lease_end(
    lease5: None,
    celery_workers: StartWorkers,
    celery_beat: Callable[[], Beat],
    shared_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    settings: Settings,
) -> None:
    got = run_partition(
        "db",
        sabotage=False,
        celery_workers=celery_workers,
        celery_beat=celery_beat,
        shared_dir=shared_dir,
        monkeypatch=monkeypatch,
        settings=settings,
    )
    tried = sorted(got["attempts"].values(), key=lambda a: a["start"])
    first, *rest = tried
    assert first["host"] == got["w1"] and first["token"] == 1, tried
    assert "end" not in first["events"], "w1's body ran to its end: it was never fenced"
    assert first["events"][-1] == "lost", first["events"][-3:]
    assert [a["host"] for a in rest] == [got["w2"]], tried
    rerun = rest[0]
    assert rerun["events"][-1] == "end"
    lease_end = got["lease_end"]
    assert lease_end is not None
    cut = got["cut_at"]
    print(
        f"\n[db partition] cut at 0; w1's last line {first['last'] - cut:.2f}s, its lease "
        f"end {lease_end - cut:.2f}s (last line {lease_end - first['last']:.2f}s before it); "
        f"re-run on w2 started {rerun['start'] - cut:.2f}s after the cut; healed "
        f"{(got['healed_at'] or cut) - cut:.2f}s"
    )
    # The body stopped (its last sign of life) before its lease ended, and before the
    # re-run began: never two bodies of the 1-slot pool alive at once.
    assert first["last"] < lease_end
    assert first["last"] < rerun["start"]
    assert max_overlap([(a["start"], a["last"]) for a in tried]) == 1
    # One completion: one attempt ran to its end and the call's result is that attempt's.
    assert sum("end" in a["events"] for a in tried) == 1
    assert got["value"]["token"] == 2 and got["value"]["hostname"] == got["w2"]


def test_partition__sabotage_without_the_watchdog_the_body_outlives_its_lease(
    lease5: None,
    celery_workers: StartWorkers,
    celery_beat: Callable[[], Beat],
    shared_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    settings: Settings,
) -> None:
    """The twin: same run, w1's watchdog off. The renewal hangs, nothing fences the body."""
    got = run_partition(
        "db",
        sabotage=True,
        celery_workers=celery_workers,
        celery_beat=celery_beat,
        shared_dir=shared_dir,
        monkeypatch=monkeypatch,
        settings=settings,
    )
    first = min(got["attempts"].values(), key=lambda a: a["start"])
    assert first["host"] == got["w1"]
    lease_end = got["lease_end"]
    assert lease_end is not None
    print(
        f"\n[db partition, no watchdog] w1's last line {first['last'] - got['cut_at']:.2f}s "
        f"after the cut, {first['last'] - lease_end:.2f}s after its lease end"
    )
    assert first["last"] > lease_end, "without the watchdog the body should outlive its lease"


def test_partition__broker_black_holed_mid_body_runs_once(
    lease5: None,
    celery_workers: StartWorkers,
    celery_beat: Callable[[], Beat],
    shared_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    settings: Settings,
) -> None:
    """w1 loses the broker for longer than a lease; its database is fine, so its keeper
    renews and the body runs to its end once; the ack waits for the heal."""
    got = run_partition(
        "broker",
        sabotage=False,
        celery_workers=celery_workers,
        celery_beat=celery_beat,
        shared_dir=shared_dir,
        monkeypatch=monkeypatch,
        settings=settings,
    )
    tried = list(got["attempts"].values())
    print(
        f"\n[broker partition] cut {BROKER_CUT:.0f}s; attempts: "
        + ", ".join(f"{a['host']} token {a['token']} {a['events'][-1]}" for a in tried)
    )
    assert len(tried) == 1, tried
    (only,) = tried
    assert only["host"] == got["w1"] and only["events"][-1] == "end"
    assert got["value"]["token"] == 1
    assert max_overlap([(a["start"], a["last"]) for a in tried]) == 1


def test_partition__sigstopped_body_is_stopped_when_it_resumes(
    lease5: None,
    celery_workers: StartWorkers,
    celery_beat: Callable[[], Beat],
    shared_dir: Path,
) -> None:
    """The limit: a frozen process cannot fence itself. Paused past its lease (the claim
    re-runs elsewhere meanwhile), the body runs again on SIGCONT until its keeper's
    watchdog, which was frozen too, sees the fence time passed. Measured, not bounded."""
    import os
    import signal

    Pool.objects.create(name=NET_POOL, slots=1)
    (w1,) = celery_workers(count=1, concurrency=1, allow_errors=True)
    celery_beat()
    result = ticking.delay(str(shared_dir), BODY)

    def first_pid() -> int | None:
        notes = [n for n in read_notes(shared_dir, "ticks") if n["event"] == "tick"]
        return int(notes[0]["pid"]) if len(notes) >= 2 else None

    pid = wait_for(first_pid, TIMEOUT, "the body to tick on w1", 0.05)
    (w2,) = celery_workers(count=1, concurrency=1)
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(
            lambda: any(
                a["host"] == w2.name for a in attempts(read_notes(shared_dir, "ticks")).values()
            ),
            TIMEOUT,
            "the claim to re-run on w2 while w1's body is frozen",
        )
    finally:
        resumed = time.time()
        os.kill(pid, signal.SIGCONT)
    result.get(timeout=TIMEOUT)
    tried = attempts(read_notes(shared_dir, "ticks"))
    first = tried[min(tried, key=lambda k: tried[k]["start"])]
    assert first["host"] == w1.name and first["events"][-1] == "lost", first["events"][-3:]
    ran = first["last"] - resumed
    print(f"\n[sigstop] the resumed body wrote its last line {ran * 1000:.0f} ms after SIGCONT")
