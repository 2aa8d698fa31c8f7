"""Many OS processes submitting the same idempotency key at once (PostgreSQL proof).

Used by ``tests/integration/core/test_idempotency_race.py``. Each child is spawned, sets Django
up on the caller's test database (as :mod:`tests.support.contention` does), waits at a barrier
with the others, then submits one entry with its own task id and the shared key, and
reports the task id it got back and whether it created the entry.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Child:
    """What one child needs (picklable)."""

    index: int
    settings_module: str
    db_name: str
    pool: str
    key: str
    skip_job: str = ""
    #: Submit a debounced call with ``key`` as its debounce key (docs/howto/debounce.md).
    debounce: bool = False


def _setup(cfg: Child) -> None:
    os.environ["DJANGO_SETTINGS_MODULE"] = cfg.settings_module
    os.environ["POOLS_TEST_DB"] = "postgres"
    os.environ["POOLS_PG_NAME"] = cfg.db_name
    from django.conf import settings

    settings.DATABASES["default"]["NAME"] = cfg.db_name
    settings.POOLS = {**settings.POOLS, "PUBLISHER": "tests.support.bridge.recorder"}
    import django

    django.setup()


def child_main(cfg: Child, barrier: Any, out: Any) -> None:
    """Submit once, right after every child reached the barrier."""
    try:
        _setup(cfg)
        from django.db import connection

        from pools.core import admission
        from pools.core.records import Submission
        from pools.specs import PoolSpec

        connection.ensure_connection()
        sub = Submission(
            key=f"race-{cfg.index}",
            task_name="tests.race",
            spec=PoolSpec.build(cfg.pool),
            args=[cfg.index],
            job=cfg.skip_job,
            concurrency_policy="skip" if cfg.skip_job else "allow",
            idempotency_key=None if cfg.debounce else cfg.key,
            debounce=30.0 if cfg.debounce else None,
            debounce_key=cfg.key if cfg.debounce else None,
        )
        barrier.wait(timeout=120)
        done = admission.enqueue(sub)
        out.put((cfg.index, done.key, done.created, ""))
    except Exception:
        out.put((cfg.index, "", False, traceback.format_exc()))


def run(
    *, processes: int, pools: list[str], key: str, skip_job: str = "", debounce: bool = False
) -> list[tuple[int, str, bool, str]]:
    """Start ``processes`` children (pools assigned round robin), return their reports."""
    from django.conf import settings
    from django.db import connection

    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(processes)
    out = ctx.Queue()
    procs = []
    for i in range(processes):
        cfg = Child(
            index=i,
            settings_module=str(settings.SETTINGS_MODULE),
            db_name=str(connection.settings_dict["NAME"]),
            pool=pools[i % len(pools)],
            key=key,
            skip_job=skip_job,
            debounce=debounce,
        )
        p = ctx.Process(target=child_main, args=(cfg, barrier, out), name=f"race-{i}")
        p.start()
        procs.append(p)
    try:
        return [out.get(timeout=180) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
