# A = base (3b3fd22: insert/delete owed rows) on q6_bench; B = main (owed work in place) on q6_new
for i in 1 2; do
  for v in A B; do
    if [ $v = A ]; then d=/work/wt/base; db=q6_bench; else d=/work/main; db=q6_new; fi
    (cd $d && POOLS_TEST_DB=postgres POOLS_PG_NAME=$db DJANGO_SETTINGS_MODULE=tests.settings PYTHONPATH=. /work/main/.venv/bin/python /tmp/q6/pvf.py P $1 1 2>&1 | grep '^{' | sed "s/\"v\": \"P\"/\"v\": \"$v\"/")
  done
done
