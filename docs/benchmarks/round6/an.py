import collections, statistics as st, sys
ev = collections.defaultdict(dict)
order = []
for line in open(sys.argv[1]):
    t, pid, what, key = line.split()
    t = float(t)
    ev[key].setdefault(what, (t, pid))
    order.append((t, pid, what, key))
def q(xs):
    xs = sorted(xs); n=len(xs)
    return f"n={n} p10={1e3*xs[n//10]:.2f} p50={1e3*xs[n//2]:.2f} p90={1e3*xs[9*n//10]:.2f} ms" if n else "n=0"
pr = [ev[k]['received'][0]-ev[k]['publish'][0] for k in ev if 'publish' in ev[k] and 'received' in ev[k]]
rs = [ev[k]['start'][0]-ev[k]['received'][0] for k in ev if 'publish' in ev[k] and 'received' in ev[k] and 'start' in ev[k]]
ps = [ev[k]['settle-call'][0]-ev[k]['postrun'][0] for k in ev if 'settle-call' in ev[k]]
sd = [ev[k]['settle-done'][0]-ev[k]['settle-call'][0] for k in ev if 'settle-done' in ev[k]]
print("publish->received", q(pr)); print("received->start", q(rs)); print("postrun->settle-call", q(ps)); print("settle call duration (incl publish)", q(sd))
# settle-call -> publish in same pid (next publish after settle-call)
sp=[]; dr=[]
last = {}
for t,pid,what,key in order:
    if what == 'settle-call': last[pid]=t
    elif what == 'publish' and pid in last: sp.append(t-last.pop(pid))
print("settle-call -> publish", q(sp))
# settle-done of settler -> start of a task in the same pid (next start)
nd = {}; ns=[]
for t,pid,what,key in order:
    if what=='settle-done': nd[pid]=t
    elif what=='start' and pid in nd: ns.append(t-nd.pop(pid))
print("settle-done -> next start in same process", q(ns))
# is the received (main) pid same worker as settler? count whether a published key is started in same pid as publisher
same = sum(1 for k in ev if 'publish' in ev[k] and 'start' in ev[k] and ev[k]['publish'][1]==ev[k]['start'][1])
tot = sum(1 for k in ev if 'publish' in ev[k] and 'start' in ev[k])
print("started in the publishing process:", same, "/", tot)
