"""A/B: enqueue/settle as procedures (v8, look again after commit) vs the plain functions (no look)."""
import json, os, sys
import django
django.setup()
from pools.bench import core
from pools.pg import engine as pg_engine, fastpath, functions

def func_call(base, pools, params, *, what):
    return fastpath.call(functions.name(base), params, what=what)

orig = pg_engine._call
variants = sys.argv[1].split(",")
procs = [int(x) for x in sys.argv[2].split(",")]
for rep in range(int(sys.argv[3])):
    for v in variants:
        pg_engine._call = func_call if v == "F" else orig
        for n in procs:
            r = core.run_once(n, 3000)
            print(json.dumps({"v": v, "rep": rep, "n": n, **{k: r.get(k) for k in ("admissions_per_s", "lock_call_ms_p50", "lock_call_ms_p99", "wal_bytes_per_task", "client_cpu_ms_per_task", "backend_cpu_ms_per_task")}}), flush=True)
