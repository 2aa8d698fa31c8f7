#!/bin/bash
# W7 before (main's code, functions v7) and after (this branch, v8), back to back, on one database.
export POOLS_TEST_DB=postgres POOLS_PG_NAME=twocommit31_bench DJANGO_SETTINGS_MODULE=tests.settings
tag=$1
for side in before after; do
  if [ $side = before ]; then dir=/work/main; else dir=/work/wt/twocommit31; fi
  echo "== $side ($dir) $(date -u +%H:%M:%S) load: $(cut -d' ' -f1-3 /proc/loadavg)"
  (cd $dir && /work/main/.venv/bin/python -m pools.bench.core --procs 1,4,16 --cycles 3000 --reps 3 2>&1 | grep '^{"')
  echo "   end $(date -u +%H:%M:%S) load: $(cut -d' ' -f1-3 /proc/loadavg)"
done
