#!/usr/bin/env bash
# `make test`: the tiers in two streams side by side, then the rate acceptance test and chaos alone.
#
# Most of the suite waits (on workers, leases, beat), so two streams on two cores take
# about the time of the longer one. Each stream has its own PostgreSQL test database and
# its own Redis databases, so nothing is shared but the servers:
#   A: PostgreSQL integration + acceptance (test_pools, Redis 14/15), then the peer suite
#      (pools_peer, Redis 0/8);
#   B: SQLite, quickstart (Redis 1), lowest versions (Redis 2/3), upgrade and PgBouncer
#      (Redis 10/11, one after the other), MariaDB (Redis 12/13), RabbitMQ (results on
#      Redis 4), browser (Redis 5/6), all on the PostgreSQL test database test_pools_b.
# Then, alone: the rate acceptance test (exact on the bodies' own clocks, so it wants the
# CPU that a second stream would take) and chaos (it restarts PostgreSQL and Redis).
# Every tier of a stream runs even after one failed; the exit status says whether all
# passed, and the summary at the end names the failed ones. TEST_STREAMS=1 runs the
# same tiers one after the other in this shell instead.
set -u
cd "$(dirname "$0")/.."
MAKE=${MAKE:-make}
STREAM_A="test-postgres test-peer"
STREAM_B="test-sqlite test-quickstart test-lowest test-upgrade test-pgbouncer test-mariadb \
test-rabbitmq test-browser"
LOGDIR=$(mktemp -d "${TMPDIR:-/tmp}/pools-test.XXXXXX")

run_stream() {  # name, environment assignments..., then the tiers after "--"
  local name=$1; shift
  local vars=()
  while [ "$1" != "--" ]; do vars+=("$1"); shift; done
  shift
  local failed=()
  for tier in "$@"; do
    local began=$SECONDS
    echo "== $tier: start $(date -u +%H:%M:%S)"
    if env "${vars[@]}" $MAKE --no-print-directory "$tier"; then
      echo "== $tier: passed in $((SECONDS - began)) s"
    else
      echo "== $tier: FAILED after $((SECONDS - began)) s"
      failed+=("$tier")
    fi
  done
  printf '%s\n' "${failed[@]}" > "$LOGDIR/$name.failed"
  [ ${#failed[@]} -eq 0 ]
}

began=$SECONDS
if [ "${TEST_STREAMS:-2}" = 1 ]; then
  run_stream all -- $STREAM_A $STREAM_B
else
  # Stream A's output goes through a prefix so the two can be told apart in one log.
  ( run_stream A -- $STREAM_A 2>&1 | sed -u 's/^/[A] /' ) &
  pid_a=$!
  run_stream B POOLS_PG_TEST_NAME=test_pools_b RABBITMQ_RESULTS=redis://127.0.0.1:6379/4 \
    BROWSER_BROKER=redis://127.0.0.1:6379/5 BROWSER_RESULTS=redis://127.0.0.1:6379/6 -- $STREAM_B 2>&1 \
    | sed -u 's/^/[B] /'
  wait "$pid_a"
fi
run_stream alone -- test-rates test-chaos

failed=$(cat "$LOGDIR"/*.failed 2>/dev/null | grep -v '^$' | tr '\n' ' ')
echo "== make test: $(((SECONDS - began) / 60)) min"
rm -rf "$LOGDIR"
if [ -n "$failed" ]; then
  echo "== FAILED tiers: $failed"
  exit 1
fi
echo "== every tier passed"
