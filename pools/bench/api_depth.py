"""REST ``GET pools/`` at depth: 100 pools, 100,000 waiting entries (docs/benchmarks.md).

Run against a scratch PostgreSQL database (the tables are created by ``migrate``)::

    POOLS_TEST_DB=postgres POOLS_PG_NAME=bench_api_depth DJANGO_SETTINGS_MODULE=tests.settings \\
        python -m pools.bench.api_depth [--pools 100] [--per-pool 1000] [--calls 9]

Each pool has 2 slots, held by 2 admitted entries, one finished entry (history for the
ETA) and ``--per-pool`` waiting entries: the first through ``enqueue``, the rest copies
written in bulk (``INSERT ... SELECT``, :func:`pools.bench.bulk_copy.copy_entries`). The
tables are vacuumed and analyzed, then ``GET pools/`` is called ``--calls`` times through
Django's test client as a user with ``pools.view_pool`` (session authentication, DRF
rendering included): the median and spread of the wall time and the query count are
printed as JSON. The rows it made are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

#: Prefix of the pools this script creates (and deletes).
PREFIX = "apidepth-"


class NullBridge:
    """Publishes nothing: the script needs rows, not messages."""

    def publish(self, admissions: Sequence[Any]) -> None:
        """Drop admitted messages."""

    def report_finished(self, finished: Sequence[Any]) -> None:
        """Drop results."""

    def wake_at(self, pools: Sequence[str], when: Any) -> None:
        """No timed wake-ups."""

    def terminate(self, key: str) -> None:
        """Nothing runs."""


null_bridge = NullBridge()


def _fill(pools: int, per_pool: int) -> None:
    from pools.bench import bulk_copy
    from pools.core import admission
    from pools.core.records import Submission
    from pools.models import Pool, QueueEntry
    from pools.specs import PoolSpec
    from pools.states import EntryState

    for i in range(pools):
        name = f"{PREFIX}{i:03}"
        Pool.objects.update_or_create(name=name, defaults={"slots": 2, "paused": False})
        spec = PoolSpec.build(name, 1)
        keys = [f"{name}-h{j}" for j in range(3)]
        for key in keys:
            admission.enqueue(Submission(key=key, task_name="bench.noop", spec=spec))
        first = QueueEntry.objects.get(key=keys[0])
        admission.settle(first.queue_id, first.token, EntryState.SUCCEEDED)  # history, admits h2
        template = f"{name}-w0"
        admission.enqueue(Submission(key=template, task_name="bench.noop", spec=spec))
        bulk_copy.copy_entries(template, range(1, per_pool), lambda j: [j], lambda j: j % 5)


def _cleanup() -> None:
    from pools.models import Demand, Pool, PoolEvent, QueueEntry

    pools = list(Pool.objects.filter(name__startswith=PREFIX))
    ids = Demand.objects.filter(pool__in=pools).values("entry_id")
    QueueEntry.objects.filter(pk__in=ids).delete()
    PoolEvent.objects.filter(pool__startswith=PREFIX).delete()
    Pool.objects.filter(pk__in=[p.pk for p in pools]).delete()


def measure(pools: int, per_pool: int, calls: int) -> dict[str, Any]:
    """Fill, time ``GET pools/`` ``calls`` times, clean up; returns the figures."""
    from django.conf import settings
    from django.contrib.auth.models import Permission, User
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext, override_settings

    from pools.bench import database
    from pools.models import Demand

    pools_settings = {**settings.POOLS, "PUBLISHER": "pools.bench.api_depth.null_bridge"}
    with override_settings(POOLS=pools_settings, ALLOWED_HOSTS=["*"]):
        _cleanup()
        began = time.perf_counter()
        _fill(pools, per_pool)
        fill_s = time.perf_counter() - began
        database.settle_tables(checkpoint=True)
        waiting = Demand.objects.waiting().filter(pool__name__startswith=PREFIX).count()
        user, _ = User.objects.get_or_create(username="apidepth-reader")
        user.user_permissions.add(Permission.objects.get(codename="view_pool"))
        client = Client()
        client.force_login(user)
        try:
            client.get("/api/pools/")  # warm-up: connections, caches
            times, queries, size, sql_ms = [], 0, 0, []
            for _ in range(calls):
                with CaptureQueriesContext(connection) as ctx:
                    t0 = time.perf_counter()
                    response = client.get("/api/pools/")
                    times.append(time.perf_counter() - t0)
                assert response.status_code == 200, response.content[:500]
                queries, size = len(ctx.captured_queries), len(response.content)
                sql_ms.append([float(q["time"]) * 1000 for q in ctx.captured_queries])
            body = response.json()
        finally:
            user.delete()
            _cleanup()
    mine = [p for p in body if p["name"].startswith(PREFIX)]
    return {
        "pools": len(mine),
        "pools_in_answer": len(body),
        "waiting_entries": waiting,
        "fill_seconds": round(fill_s, 1),
        "calls": calls,
        "median_ms": round(statistics.median(times) * 1000, 1),
        "min_ms": round(min(times) * 1000, 1),
        "max_ms": round(max(times) * 1000, 1),
        "queries": queries,
        # Median time of each query (in order: session, user, permissions x2, pools with
        # their heads, counts per state, holders, history, head rows).
        "query_ms": [round(statistics.median(col), 1) for col in zip(*sql_ms, strict=True)],
        "response_bytes": size,
        "head_of_first_pool": [(w["position"], w["blocked_by"]) for w in mine[0]["waiting"]],
        "database": connection.vendor,
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    import django

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pools", type=int, default=100)
    parser.add_argument("--per-pool", type=int, default=1000)
    parser.add_argument("--calls", type=int, default=9)
    parser.add_argument("--migrate", action="store_true", help="run migrate first")
    args = parser.parse_args(argv)
    django.setup()
    if args.migrate:
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
    print(json.dumps(measure(args.pools, args.per_pool, args.calls), indent=2))


if __name__ == "__main__":
    main()
