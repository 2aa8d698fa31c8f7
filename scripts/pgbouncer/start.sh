#!/usr/bin/env bash
# Start PgBouncer (transaction mode) on 127.0.0.1:$POOLS_PGBOUNCER_PORT (default 6433) in
# front of 127.0.0.1:5432, with the configuration next to this script. Idempotent.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
port="${POOLS_PGBOUNCER_PORT:-6433}"
dir="${POOLS_PGBOUNCER_DIR:-/tmp/pools-pgbouncer-$port}"
bin="$(command -v pgbouncer || echo /usr/sbin/pgbouncer)"
if [ ! -x "$bin" ]; then
    echo "pgbouncer is missing: apt-get install pgbouncer (make pgbouncer does it)" >&2
    exit 1
fi
mkdir -p "$dir"
if [ -f "$dir/pgbouncer.pid" ] && kill -0 "$(cat "$dir/pgbouncer.pid")" 2>/dev/null; then
    exit 0  # already running
fi
sed -e "s|@PORT@|$port|" -e "s|@DIR@|$dir|g" "$here/pgbouncer.ini" > "$dir/pgbouncer.ini"
echo '"postgres" ""' > "$dir/userlist.txt"
user=()
if [ "$(id -u)" = 0 ]; then  # PgBouncer refuses to run as root
    chown -R postgres "$dir"
    user=(-u postgres)
fi
"$bin" -d "${user[@]}" "$dir/pgbouncer.ini"
for _ in $(seq 50); do
    if (echo > "/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
        echo "$("$bin" --version | head -1) in transaction mode on 127.0.0.1:$port ($dir)"
        exit 0
    fi
    sleep 0.1
done
echo "pgbouncer did not start on 127.0.0.1:$port; see $dir/pgbouncer.log" >&2
exit 1
