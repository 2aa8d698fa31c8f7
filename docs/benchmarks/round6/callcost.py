import psycopg, time, os
conn = psycopg.connect("host=127.0.0.1 user=postgres dbname=q6_bench", autocommit=True)
conn.execute("""CREATE OR REPLACE PROCEDURE q6_proc(p int, INOUT o jsonb) LANGUAGE plpgsql AS $$
BEGIN o := jsonb_build_array(p); COMMIT; PERFORM 1 FROM pools_pool WHERE id = -1; END $$""")
conn.execute("""CREATE OR REPLACE PROCEDURE q6_proc0(p int, INOUT o jsonb) LANGUAGE plpgsql AS $$
BEGIN o := jsonb_build_array(p); END $$""")
conn.execute("""CREATE OR REPLACE FUNCTION q6_func(p int) RETURNS TABLE(a int) LANGUAGE plpgsql AS $$
BEGIN RETURN QUERY SELECT p; END $$""")
pid = conn.info.backend_pid
def ticks(pid):
    f = open(f"/proc/{pid}/stat").read(); f = f[f.rfind(")")+2:].split(); return int(f[11]) + int(f[12])
N = 5000
for name, sql in [("func", "SELECT * FROM q6_func(%s)"), ("proc0", "CALL q6_proc0(%s, NULL)"), ("proc_commit", "CALL q6_proc(%s, NULL)"), ("func", "SELECT * FROM q6_func(%s)"), ("proc_commit", "CALL q6_proc(%s, NULL)")]:
    cur = conn.cursor()
    b0, c0, t0 = ticks(pid), time.process_time(), time.perf_counter()
    for i in range(N):
        cur.execute(sql, [i], prepare=True); cur.fetchall()
    b1, c1, t1 = ticks(pid), time.process_time(), time.perf_counter()
    print(f"{name:12s} wall {1e6*(t1-t0)/N:6.1f} us  client {1e6*(c1-c0)/N:6.1f} us  backend {1e6*(b1-b0)/100/N:6.1f} us")
