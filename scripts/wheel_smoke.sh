#!/usr/bin/env bash
# The README's steps against a built wheel, in a fresh venv and a new Django project:
# install with the redis and postgres extras, the README's settings, check, migrate,
# `pools list`, `pools bench` (not in the wheel: it says so), then a real Celery worker
# runs pooled calls to the end.
#
#   bash scripts/wheel_smoke.sh [dist/django_celery_pools-X.Y.Z-py3-none-any.whl]
#
# PostgreSQL database $POOLS_SMOKE_DB (default pools_smoke; created, then dropped) on
# 127.0.0.1:5432 as postgres; broker and results on $POOLS_SMOKE_REDIS (default Redis db 1).
set -euo pipefail

WHEEL=$(realpath "${1:-$(ls dist/*.whl)}")
DB=${POOLS_SMOKE_DB:-pools_smoke}
REDIS=${POOLS_SMOKE_REDIS:-redis://127.0.0.1:6379/1}
PY=${PY:-python3}
WORK=$(mktemp -d /tmp/pools-smoke-XXXXXX)
WORKER=""

finish() {
	status=$?
	[ -n "$WORKER" ] && kill -TERM "$WORKER" 2>/dev/null && wait "$WORKER" 2>/dev/null
	[ -x "$WORK/venv/bin/python" ] && "$WORK/venv/bin/python" - "$DB" <<-'EOF' || true
		import sys, psycopg
		with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as c:
		    c.execute(f'DROP DATABASE IF EXISTS "{sys.argv[1]}"')
	EOF
	rm -rf "$WORK"
	[ "$status" = 0 ] && echo "wheel smoke test passed: $WHEEL" || echo "wheel smoke test FAILED"
	exit "$status"
}
trap finish EXIT

echo "== fresh venv, pip install '$(basename "$WHEEL")[redis,postgres]'"
$PY -m venv "$WORK/venv"
BIN=$WORK/venv/bin
"$BIN/python" -m pip install -q "$WHEEL[redis,postgres]"

echo "== a new project with the README's settings"
cd "$WORK"
"$BIN/django-admin" startproject proj
cd proj
"$BIN/python" manage.py startapp inventory
cat > proj/celery.py <<'EOF'
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
app = Celery("proj")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
EOF
printf 'from .celery import app as celery_app\n\n__all__ = ("celery_app",)\n' > proj/__init__.py
cat > inventory/tasks.py <<'EOF'
from celery import shared_task

from pools import pooled


@shared_task
@pooled("warehouse", slots=2, priority=10, queue_timeout=1800)
def export(day):
    return f"exported {day}"
EOF
cat >> proj/settings.py <<EOF

INSTALLED_APPS += ["django_celery_beat", "rest_framework", "pools", "pools_admin", "inventory"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "$DB",
        "USER": "postgres",
        "HOST": "127.0.0.1",
        "PORT": 5432,
    }
}
POOLS = {
    "DEFINITIONS": {
        "warehouse": {"slots": 4, "max_queued": 100},
        "partner-api": {"slots": 1},
    },
}
CELERY_BROKER_URL = "$REDIS"
CELERY_RESULT_BACKEND = "$REDIS"
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_DB_REUSE_MAX = 1000
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
EOF
"$BIN/python" - "$DB" <<'EOF'
import sys, psycopg
with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as c:
    c.execute(f'DROP DATABASE IF EXISTS "{sys.argv[1]}"')
    c.execute(f'CREATE DATABASE "{sys.argv[1]}"')
EOF

echo "== check, migrate, pools list"
"$BIN/python" manage.py check --fail-level WARNING
"$BIN/python" manage.py migrate -v 0
"$BIN/python" manage.py pools list | tee pools-list.txt
grep -q warehouse pools-list.txt && grep -q partner-api pools-list.txt

echo "== pools bench: not in the wheel, and it says how to run it from a checkout"
if "$BIN/python" manage.py pools bench > bench.txt 2>&1; then
	cat bench.txt && echo "pools bench ran from the wheel" && exit 1
fi
cat bench.txt
grep -q "runs from a checkout of the repository" bench.txt && grep -q "make install" bench.txt
"$BIN/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('pools.bench') is not None)"

echo "== a worker runs pooled calls"
"$BIN/celery" -A proj worker -c 2 -l warning --without-heartbeat --without-gossip \
	--without-mingle > worker.log 2>&1 &
WORKER=$!
"$BIN/python" manage.py shell -c '
from inventory.tasks import export
import pools
results = [export.delay(f"2026-12-{d:02d}") for d in range(1, 9)]
got = [r.get(timeout=60) for r in results]
assert got == [f"exported 2026-12-{d:02d}" for d in range(1, 9)], got
snap = pools.snapshot("warehouse")
states = sorted({str(item.state) for item in snap.recent})
assert (snap.held, snap.waiting, states) == (0, 0, ["succeeded"]), (snap.held, snap.waiting, states)
print(f"{len(got)} pooled calls ran; warehouse: {snap.held} held, {snap.waiting} waiting")
'
