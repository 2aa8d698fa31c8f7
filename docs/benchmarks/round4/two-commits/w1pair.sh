#!/bin/bash
# W1 before (main's code) and after (this branch), back to back, one database, Redis 9/12.
export POOLS_TEST_DB=postgres POOLS_PG_NAME=twocommit31_bench DJANGO_SETTINGS_MODULE=tests.settings DJANGO_DEBUG=0
export CELERY_BROKER_URL=redis://127.0.0.1:6379/9 CELERY_RESULT_BACKEND=redis://127.0.0.1:6379/12
tag=$1
for side in before after; do
  if [ $side = before ]; then dir=/work/main; else dir=/work/wt/twocommit31; fi
  echo "== $side ($dir @ $(git -C $dir rev-parse --short HEAD)) $(date -u +%H:%M:%S) load: $(cut -d' ' -f1-3 /proc/loadavg)"
  (cd $dir && timeout 900 /work/main/.venv/bin/python -m django pools bench --workloads W1 --reps 2 --tasks 500 --slow-tasks 300 --out /tmp/tc31/w1-$side-$tag 2>&1 | grep -v "\[" )
  echo "   end $(date -u +%H:%M:%S) load: $(cut -d' ' -f1-3 /proc/loadavg)"
done
