"""The whole benchmark run: set up, run the workloads, report, clean up."""

from __future__ import annotations

import os
import platform
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from celery.utils import uuid
from django.db import connection

from pools import conf
from pools.bench import backlog, cpu, database, errors, report
from pools.bench.context import Context, Options
from pools.bench.workers import (
    FLOOR_QUEUE,
    IDLE_QUEUE,
    MEM_PLAIN_QUEUE,
    MEM_POOLED_QUEUE,
    PLAIN_QUEUE,
    POOLED_QUEUE,
    RECIPE_QUEUE,
    Fleet,
    error_lines,
    settings_module,
)


def default_app_path() -> str:
    """The package of the settings module (``example_project.settings`` -> ``example_project``)."""
    module = settings_module()
    return module.rsplit(".", 1)[0] if "." in module else module


def load_app(path: str) -> Any:
    """Import the project's Celery app as ``celery -A path`` would, and make it current."""
    from celery.app.utils import find_app

    app = find_app(path)
    app.set_current()
    app.set_default()
    from pools.bench import tasks  # noqa: F401  (registers the bench tasks on the app)

    return app


def run(options: Options, stdout: Any = None) -> dict[str, Any]:
    """Run the benchmark; returns the result dict (also written to ``<out>/bench.json``)."""
    stdout = stdout or sys.stdout
    began = time.monotonic()
    out = options.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    app_path = options.app or default_app_path()
    app = load_app(app_path)
    _require_result_backend(app)
    ctx = Context(
        options=options,
        app=app,
        app_path=app_path,
        fleet=Fleet(
            app, app_path, out / "logs", uuid()[:8], extra_args=shlex.split(options.worker_args)
        ),
        run_id=uuid()[:8],
    )
    ctx.results["options"] = options.as_dict()
    ctx.results["command"] = f"pools bench {options.command_line()}"
    ctx.results["meta"] = _meta(ctx)
    print(f"Options: {options.command_line()}", file=sys.stderr)
    left = backlog.remove_pools()
    if left:
        ctx.notes.append(f"removed {left} entries left by an earlier, interrupted run")
    redis_url = options.recipe_redis or (
        app.conf.broker_url if str(app.conf.broker_url or "").startswith("redis") else None
    )
    from pools.bench import tasks

    routes = tasks.route_wakeups(app, POOLED_QUEUE)
    try:
        _start_workers(ctx)
        _warm_up(ctx)
        ctx.results["meta"]["setup_seconds"] = time.monotonic() - began
        seconds = ctx.results["meta"]["workload_seconds"] = {}
        for name in options.workloads:
            if name == "W5" and not redis_url:
                ctx.results[name] = {"skipped": "the recipe needs Redis: pass --recipe-redis"}
                continue
            step = time.monotonic()
            ctx.results[name] = _attempt(ctx, name, redis_url)
            seconds[name] = time.monotonic() - step
        ctx.results["worker_errors"] = {
            w.name: errors[:20] for w in ctx.fleet.workers if (errors := error_lines(w))
        }
    finally:
        print("Stopping the benchmark's workers and cleaning up ...", file=sys.stderr)
        tasks.restore_routes(app, routes)  # the calling process's app is the project's again
        ctx.fleet.stop()
        if not options.keep:
            try:
                _clean(ctx, redis_url)
            except Exception as exc:  # report what was measured all the same
                ctx.notes.append(f"clean-up failed: {exc!r}")
                print(f"Clean-up failed: {exc!r}", file=sys.stderr)
    ctx.results["meta"]["loadavg_after"] = _loadavg()
    ctx.results["meta"]["cpu"] = cpu.machine_share(
        ctx.results["meta"].pop("cpu_ticks_before", None)
    )
    ctx.results["meta"]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    ctx.results["meta"]["seconds"] = time.monotonic() - began  # the plots come after
    ctx.results["notes"] = ctx.notes
    ctx.results["targets"] = report.targets(ctx.results)
    report.write(ctx.results, out, plots=not options.no_plots)
    stdout.write(report.table(ctx.results) + "\n")
    stdout.write(f"Results: {out / 'bench.json'}\n")
    return ctx.results


def _workload(ctx: Context, name: str, redis_url: str | None) -> dict[str, Any]:
    from pools.bench import comparison, memory, rates, workloads

    if name == "W1":
        return workloads.w1_throughput(ctx)
    if name == "W2":
        return workloads.w2_handoff(ctx)
    if name == "W3":
        return workloads.w3_depth(ctx)
    if name == "W4":
        return workloads.w4_many_pools(ctx)
    if name == "W5":
        assert redis_url is not None
        return comparison.w5_recipe(ctx, redis_url)
    if name == "memory":
        return memory.memory(ctx)
    if name == "rates":
        return rates.rates(ctx)
    raise ValueError(f"unknown workload {name!r}")


def _attempt(ctx: Context, name: str, redis_url: str | None) -> dict[str, Any]:
    """Run one workload; a failure is recorded (and the others still run)."""
    try:
        return _workload(ctx, name, redis_url)
    except (errors.BenchError, AssertionError, RuntimeError) as exc:
        print(f"{name} failed: {exc}", file=sys.stderr)
        return {"error": str(exc), "traceback": traceback.format_exc()}


def _start_workers(ctx: Context) -> None:
    from pools.bench import tasks

    o = ctx.options
    names = set(o.workloads)
    many = tasks.MANY_POOLS if "W4" in names else []
    backlog.create_pools(
        {
            tasks.W1_POOL: o.total_concurrency,
            tasks.W2_POOL: 1,
            tasks.W3_POOL: o.total_concurrency,
            **dict.fromkeys(many, 1),
            tasks.MULTI_A: max(1, o.total_concurrency // 2),
            tasks.MULTI_B: max(1, o.total_concurrency // 2),
            # Its rate is set by the ``rates`` workload; the slots never bind (one per process).
            tasks.RATE_POOL: o.total_concurrency,
        }
    )
    fleet = ctx.fleet
    ctx.main = [
        fleet.start(f"bench{n + 1}", o.concurrency, [POOLED_QUEUE]) for n in range(o.workers)
    ]
    if "W2" in names:
        ctx.floor = fleet.start("bench-floor", 1, [IDLE_QUEUE])
    if "memory" in names:
        ctx.mem_plain = fleet.start("bench-mem-plain", o.concurrency, [MEM_PLAIN_QUEUE])
        ctx.mem_pooled = fleet.start("bench-mem-pooled", o.concurrency, [MEM_POOLED_QUEUE])
    started = time.monotonic()
    fleet.wait_ready(fleet.workers)
    print(
        f"{len(fleet.workers)} workers ready in {time.monotonic() - started:.1f} s "
        f"(logs: {ctx.options.out / 'logs'})",
        file=sys.stderr,
    )


def _warm_up(ctx: Context) -> None:
    """A small plain and pooled run first: pool processes import, connect and fill caches."""
    from pools.bench import tasks
    from pools.bench.runs import plain_run, pooled_run

    n = 4 * ctx.options.total_concurrency
    plain_run(
        ctx,
        "warm-up plain",
        tasks.plain,
        n,
        lambda j: [j, 0.0],
        queue=PLAIN_QUEUE,
        workers=ctx.main,
    )
    pooled_run(
        ctx, "warm-up pooled", [(tasks.POOLED[tasks.W1_POOL], range(n))], [tasks.W1_POOL], real=n
    )


def _clean(ctx: Context, redis_url: str | None) -> None:
    deleted = backlog.remove_pools()
    backlog.forget_results(ctx.app, ctx.task_ids)
    if redis_url and ctx.semaphores:
        import redis

        client = redis.Redis.from_url(redis_url)
        client.delete(*ctx.semaphores)
        client.close()
    _forget_queues(ctx.app)
    print(
        f"Removed {deleted} entries of the bench pools and {len(ctx.task_ids)} results.",
        file=sys.stderr,
    )


def _forget_queues(app: Any) -> None:
    """Redis broker: drop kombu's routing keys of the benchmark's queues (they are empty)."""
    url = str(app.conf.broker_url or "")
    if not url.startswith("redis"):
        return
    import redis

    queues = [POOLED_QUEUE, PLAIN_QUEUE, RECIPE_QUEUE, FLOOR_QUEUE, IDLE_QUEUE]
    queues += [MEM_PLAIN_QUEUE, MEM_POOLED_QUEUE]
    client = redis.Redis.from_url(url)
    try:
        client.delete(*[f"_kombu.binding{kind}.{q}" for q in queues for kind in ("", "_permanent")])
    finally:
        client.close()


def _require_result_backend(app: Any) -> None:
    from celery.backends.base import DisabledBackend

    if isinstance(app.backend, DisabledBackend):
        raise errors.BenchError(
            "The benchmark reads the task bodies' timings from the result backend: set "
            "CELERY_RESULT_BACKEND (e.g. redis://...)."
        )


def _loadavg() -> list[float]:
    try:
        return [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return list(os.getloadavg())


def _autovacuum() -> bool | None:
    if connection.vendor != "postgresql":
        return None
    setting: str = database.scalar("SHOW autovacuum")
    return setting == "on"


def _meta(ctx: Context) -> dict[str, Any]:
    import celery
    import django

    db = connection.settings_dict
    version = str(
        database.scalar(
            "SELECT sqlite_version()" if connection.vendor == "sqlite" else "SELECT version()"
        )
        or ""
    )
    app = ctx.app
    o = ctx.options
    return {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "loadavg_before": _loadavg(),
        "cpu_ticks_before": cpu.machine_counters(),
        "cpus": os.cpu_count(),
        "memory_bytes": _mem_total(),
        "python": platform.python_version(),
        "django": django.get_version(),
        "celery": celery.__version__,
        "database": {
            "vendor": connection.vendor,
            "name": str(db.get("NAME")),
            "version": version,
            "autovacuum": _autovacuum(),
        },
        "broker": _transport(app),
        "result_backend": type(app.backend).__name__,
        "acks_late": bool(app.conf.task_acks_late),
        "prefetch_multiplier": app.conf.worker_prefetch_multiplier,
        "lease_seconds": conf.get().LEASE_SECONDS,
        "workers": o.workers,
        "concurrency": o.concurrency,
        "reps": o.reps,
        "app": ctx.app_path,
        "revision": _revision(),
    }


def _revision() -> str:
    """``git describe`` of the pools checkout, when it is one (else empty)."""
    import subprocess

    here = Path(__file__).resolve().parent
    try:
        return subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout.strip()
    except OSError:
        return ""


def _transport(app: Any) -> str:
    with app.connection_for_write() as conn:
        return str(conn.transport_cls)


def _mem_total() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
