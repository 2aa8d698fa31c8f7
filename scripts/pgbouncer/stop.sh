#!/usr/bin/env bash
# Stop the PgBouncer start.sh started on $POOLS_PGBOUNCER_PORT (default 6433), if running.
set -euo pipefail
port="${POOLS_PGBOUNCER_PORT:-6433}"
dir="${POOLS_PGBOUNCER_DIR:-/tmp/pools-pgbouncer-$port}"
if [ -f "$dir/pgbouncer.pid" ]; then
    pid="$(cat "$dir/pgbouncer.pid")"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || exit 0; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
fi
