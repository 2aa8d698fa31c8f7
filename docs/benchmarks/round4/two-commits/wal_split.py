"""WAL of one pooled task, split by what wrote it (round four, two commits per task).

Runs ``--cycles`` times enqueue -> start -> settle in one process on pools' own connection
(as W7 at N = 1 does, and as a worker starts and settles), then reads this database's WAL
records since the first call (``pg_walinspect``) and groups them by relation and record
type. The *held message* is the heap INSERT of the entry row (the call's arguments and
options, which pools keeps until admission): what a broker would have stored instead.

    cd <tree> && POOLS_TEST_DB=postgres POOLS_PG_NAME=<db> DJANGO_SETTINGS_MODULE=tests.settings \\
        python <this file> [--cycles 500]

Works with the code of any tree that has ``pools.bench.core`` (run from that tree).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import uuid
from collections import defaultdict

sys.path.insert(0, ".")

import django  # noqa: E402

django.setup()

from django.db import connection  # noqa: E402
from django.test.utils import override_settings  # noqa: E402

from pools.bench import core  # noqa: E402
from pools.core import admission, leases  # noqa: E402
from pools.core.records import Submission  # noqa: E402
from pools.pg import fastpath  # noqa: E402
from pools.specs import PoolSpec  # noqa: E402

RECORDS = """
SELECT r.xid::text, r.resource_manager, r.record_type, r.record_length,
       substring(r.block_ref from 'rel \\d+/(\\d+)/(\\d+)') AS db,
       substring(r.block_ref from 'rel \\d+/\\d+/(\\d+)') AS relfilenode
  FROM pg_get_wal_records_info(%s::pg_lsn, pg_current_wal_flush_lsn()) r
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cycles", type=int, default=500)
    cycles = parser.parse_args().cycles
    core._reset()
    from pools.models import Pool

    Pool.objects.create(name=core.POOL, slots=1)
    fastpath.use_own_connection()
    spec = PoolSpec.build(core.POOL, 1)
    passes_start = "started_at" in inspect.signature(admission.settle).parameters
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_current_wal_lsn()::text, oid FROM pg_database "
                       "WHERE datname = current_database()")
        start, dboid = cursor.fetchone()
    with override_settings(POOLS={"PUBLISHER": "pools.bench.core.bridge"}):
        for i in range(cycles):
            admission.enqueue(Submission(key=str(uuid.uuid4()), task_name="w7.noop", spec=spec,
                                         args=[], fairness_key=f"t{i % 100}"))
            while core._admitted:
                adm = core._admitted.pop(0)
                claim = leases.start(adm.entry_id, adm.token, worker="wal-split")
                assert claim is not None
                extra = {}
                if passes_start:
                    extra = {"started_at": claim.started_at, "worker": claim.worker}
                assert admission.settle(adm.entry_id, adm.token, "succeeded", live_lease=True,
                                        **extra)
    names = {}
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_relation_filenode(oid)::text, relname FROM pg_class "
                       "WHERE pg_relation_filenode(oid) IS NOT NULL")
        names = dict(cursor.fetchall())
        cursor.execute(RECORDS, [start])
        rows = cursor.fetchall()
    mine = {xid for xid, _, _, _, db, _ in rows if db == str(dboid) and xid != "0"}
    groups: dict[str, float] = defaultdict(float)
    commits = 0
    for xid, rmgr, rtype, length, db, rel in rows:
        if db != str(dboid) and xid not in mine:
            continue
        if rmgr == "Transaction":
            commits += rtype.startswith("COMMIT")
            key = f"Transaction {rtype}"
        else:
            key = f"{names.get(rel, rel)} {rmgr} {rtype}"
        groups[key] += length
    total = sum(groups.values())
    held = sum(v for k, v in groups.items() if k.startswith("pools_queueentry Heap INSERT"))
    out = {
        "cycles": cycles,
        "settle_passes_start": passes_start,
        "wal_bytes_per_task": round(total / cycles, 1),
        "held_message_bytes_per_task": round(held / cycles, 1),
        "rest_bytes_per_task": round((total - held) / cycles, 1),
        "commits_per_task": round(commits / cycles, 2),
        "by_record": {k: round(v / cycles, 1) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
    }
    print(json.dumps(out, indent=2))
    fastpath.use_own_connection(False)
    core._reset(ballast=True)


if __name__ == "__main__":
    main()
