for v in A B A B; do
  if [ $v = A ]; then d=/work/wt/base; db=q6_bench; else d=/work/main; db=q6_new; fi
  (cd $d && POOLS_TEST_DB=postgres POOLS_PG_NAME=$db DJANGO_SETTINGS_MODULE=tests.settings PYTHONPATH=. /work/main/.venv/bin/python - <<PY 2>&1 | grep '^{' | sed "s/^/$v /"
import json, django
django.setup()
from pools.bench import core
r = core.run_once($1, $2)
print(json.dumps({k: r.get(k) for k in ("procs","tasks","admissions_per_s","lock_call_ms_p50","lock_call_ms_p99","wal_bytes_per_task","client_cpu_ms_per_task","backend_cpu_ms_per_task")}))
PY
  )
  psql -h 127.0.0.1 -U postgres -d $db -Atc "select relname, n_dead_tup from pg_stat_user_tables where relname like 'pools_owed%'" | sed "s/^/   /"
done
