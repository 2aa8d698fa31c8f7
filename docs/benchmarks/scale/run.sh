#!/usr/bin/env bash
# The scale matrix of docs/benchmarks.md ("Scale: pools, processes and one database"), as
# run: W7 with --pools on PostgreSQL 15 at 127.0.0.1:5432 (max_connections = 100), then
# N = 64 again through PgBouncer in transaction mode (scripts/pgbouncer/, port 6435).
# From the repository root, with a migrated scratch database ($POOLS_PG_NAME).
set -euo pipefail
out="${OUT:-docs/benchmarks/scale}"
py="${PY:-.venv/bin/python}"
export POOLS_TEST_DB=postgres POOLS_PG_NAME="${POOLS_PG_NAME:-scale31_bench}"
export DJANGO_SETTINGS_MODULE=tests.settings
mark() { echo "$(date -u +%H:%M:%S) $1: $(uptime)" >> "$out/uptime.txt"; }
w7() {
    local name=$1
    shift
    mark "before $name"
    "$py" -m pools.bench.core --reps 3 "$@" > "$out/$name.txt" 2> "$out/$name.err" || echo "exit $?" >> "$out/$name.txt"
    mark "after $name"
}
w7 n1 --procs 1 --pools 1,1000 --cycles 2000
w7 n4 --procs 4 --pools 1,100 --cycles 2000
w7 n16 --procs 16 --pools 1,10,100,1000 --cycles 2000
w7 n64 --procs 64 --pools 1,10,100,1000 --cycles 1500
POOLS_PGBOUNCER_PORT=6435 bash scripts/pgbouncer/start.sh
POOLS_PG_PORT=6435 POOLS_PG_POOLER=transaction w7 n64-pgbouncer \
    --procs 64 --pools 1,100 --cycles 1500
POOLS_PGBOUNCER_PORT=6435 bash scripts/pgbouncer/stop.sh
