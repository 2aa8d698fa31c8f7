"""Rate limits: the sliding-window checker, and the ``rates`` workload.

The checker (:func:`max_in_window`, :func:`achieved_rate`) is pure counting over start
times, used both by this workload and by the acceptance test
``tests/acceptance/test_rates_workers.py``: one place decides what "no window of W seconds
holds more than N starts" means.

The workload (``manage.py pools bench --workloads rates``) runs on the benchmark's main
workers (``--workers`` x ``--concurrency``, 2 x 4 by default):

* ``pool``: ``--rate-tasks`` no-op tasks (300) through a pool of :data:`LIMIT`
  (``"20/s"``; its slots, one per worker process, never bind), released at once: the most
  starts any 1-second window of the bodies' own start times holds, and the achieved rate
  while backlogged; on PostgreSQL also the same of the admissions themselves, at the
  database's clock (:class:`AdmissionLog`), where the guarantee is exact;
* ``celery``: the same count of plain tasks with Celery's own ``rate_limit="20/s"`` on the
  same workers. Celery keeps one token bucket per worker *instance* (the consumer in each
  worker's main process, ``kombu.utils.limits.TokenBucket(limit, capacity=1)``), so the
  fleet as a whole starts up to ``workers x 20`` per second;
* ``cost``: the W1 no-op loop (``--tasks``) through the W1 pool with no rate, again with
  a rate that never binds (:data:`NEVER_BINDS`), and with a spend cap that never binds
  (which takes the same Python admission pass as a rate, without one): tasks/s and CPU ms
  per task side by side, what the rate check costs and how much of it is the Python pass.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pools.bench.context import Context

#: The rate of the comparison, ours and Celery's.
LIMIT = "20/s"
LIMIT_COUNT, LIMIT_SECONDS = 20, 1.0
#: A rate no run here can reach: the check runs on every admission but never refuses.
NEVER_BINDS = "100000/s"


# --------------------------------------------------------------------------- the checker


def max_in_window(times: Iterable[float], window: float) -> tuple[int, float]:
    """The most ``times`` any half-open window ``[t, t + window)`` holds, and its start ``t``.

    Only windows that start at one of the times need checking: sliding a window's start
    forward to the first time inside it loses nothing. ``(0, nan)`` when there are none.
    """
    ordered = sorted(float(t) for t in times)
    best, at = 0, math.nan
    for i, start in enumerate(ordered):
        inside = bisect.bisect_left(ordered, start + window, lo=i) - i
        if inside > best:
            best, at = inside, start
    return best, at


def achieved_rate(times: Iterable[float], window: float) -> float:
    """Starts per second over the whole windows from the first start.

    ``k = floor((last - first) / window)`` windows fit between the first and the last
    start; the rate is the starts in ``[first, first + k * window)`` over ``k * window``.
    Counting whole windows is fair to a limiter that admits in bursts (a sliding window
    admits ``N`` at once when it opens) as well as to one that spaces its admissions
    evenly: either gives ``N / window`` when it keeps up. ``nan`` when less than one
    window separates the first and the last start.
    """
    ordered = sorted(float(t) for t in times)
    if len(ordered) < 2:
        return math.nan
    k = math.floor((ordered[-1] - ordered[0]) / window)
    if k < 1:
        return math.nan
    span = k * window
    inside = bisect.bisect_left(ordered, ordered[0] + span)
    return inside / span


#: Windows shown one by one in a run's report (``per_window``).
SHOWN_WINDOWS = 30


def window_report(times: Sequence[float], count: int, seconds: float) -> dict[str, Any]:
    """What a run did against the rate ``count / seconds``: most starts in any window, rate,
    and the starts in each whole window from the first (the first :data:`SHOWN_WINDOWS`)."""
    most, at = max_in_window(times, seconds)
    rate = achieved_rate(times, seconds)
    first = min(times) if times else math.nan
    per_window = [0] * SHOWN_WINDOWS
    for t in times:
        n = int((t - first) // seconds)
        if n < SHOWN_WINDOWS:
            per_window[n] += 1
    return {
        "limit": f"{count}/{seconds:g}s",
        "starts": len(times),
        "max_in_window": most,
        "max_window_at_s": None if math.isnan(at) else round(at - first, 3),
        "achieved_per_s": None if math.isnan(rate) else round(rate, 2),
        "achieved_share": None if math.isnan(rate) else round(rate * seconds / count, 3),
        "seconds": round(max(times) - first, 3) if times else None,
        "per_window": per_window,
    }


# --------------------------------------------------------------------------- the log


class AdmissionLog:
    """An independent record of every admission of rated pools, at the database's clock.

    The core keeps, per pool and rate, a ring of the times of the last ``N`` admissions
    (``RateMark`` rows, overwritten as the ring turns: :mod:`pools.core.windows`). While
    this log is open, a trigger copies each mark as it is written — one per admission and
    rate, stamped with the database clock — into a table the core never reads, so every
    admission is kept in order. PostgreSQL only (:meth:`available`); a context manager
    that drops its table, function and trigger on exit (and any an interrupted run left).
    """

    TABLE = "pools_bench_rate_log"
    FUNCTION = "pools_bench_rate_log_row"
    TRIGGER = "pools_bench_rate_log"

    @staticmethod
    def available() -> bool:
        """True on PostgreSQL (the trigger is PL/pgSQL)."""
        from django.db import connection

        return connection.vendor == "postgresql"

    def _marks(self) -> str:
        from django.db import connection

        from pools.models import RateMark

        return str(connection.ops.quote_name(RateMark._meta.db_table))

    def __enter__(self) -> AdmissionLog:
        from django.db import connection

        self._drop()
        with connection.cursor() as cursor:
            cursor.execute(
                f"CREATE TABLE {self.TABLE} (id bigserial PRIMARY KEY, pool_id bigint, "
                "rate_index int, slot bigint, at timestamptz)"
            )
            cursor.execute(
                f"CREATE FUNCTION {self.FUNCTION}() RETURNS trigger LANGUAGE plpgsql AS $$ "
                f"BEGIN INSERT INTO {self.TABLE} (pool_id, rate_index, slot, at) "
                "VALUES (NEW.pool_id, NEW.rate_index, NEW.slot, NEW.at); RETURN NEW; END $$"
            )
            cursor.execute(
                f"CREATE TRIGGER {self.TRIGGER} AFTER INSERT OR UPDATE ON {self._marks()} "
                f"FOR EACH ROW EXECUTE FUNCTION {self.FUNCTION}()"
            )
        return self

    def __exit__(self, *exc: object) -> None:
        self._drop()

    def _drop(self) -> None:
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute(f"DROP TRIGGER IF EXISTS {self.TRIGGER} ON {self._marks()}")
            cursor.execute(f"DROP FUNCTION IF EXISTS {self.FUNCTION}()")
            cursor.execute(f"DROP TABLE IF EXISTS {self.TABLE}")

    def clear(self) -> None:
        """Forget what was logged so far."""
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute(f"DELETE FROM {self.TABLE}")

    def read(self, pool: str, rate_index: int = 0) -> tuple[int, list[float]]:
        """``(first slot, times)``: the admissions of ``pool`` logged for its rate number
        ``rate_index``, in order, as POSIX seconds of the database clock.

        Admission number ``k`` writes slot ``k mod N``, so the slots logged must follow
        each other from the first one: a gap would mean an admission without its mark.
        """
        from django.db import connection

        from pools.core import rates as core_rates
        from pools.models import Pool

        row = Pool.objects.get(name=pool)
        count = core_rates.parse_rates(row.rate)[rate_index].count
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT slot, extract(epoch FROM at) FROM {self.TABLE} "
                "WHERE pool_id = %s AND rate_index = %s ORDER BY id",
                [row.pk, rate_index],
            )
            logged = [(int(slot), float(at)) for slot, at in cursor.fetchall()]
        if not logged:
            return 0, []
        first = logged[0][0]
        slots = [slot for slot, _ in logged]
        if slots != [(first + k) % count for k in range(len(logged))]:
            raise AssertionError(f"the marks of {pool!r} skip admissions: slots {slots[:50]}")
        return first, [at for _, at in logged]


# --------------------------------------------------------------------------- the workload


def set_rate(name: str, rate: str | list[str] | None) -> None:
    """Give pool ``name`` the rate(s) ``rate`` (None: none), through the pool service."""
    from pools.core import definitions

    definitions.update_pool(name, rate=rate)


def _starts(spans: Sequence[dict[str, Any]]) -> list[float]:
    return [float(s["s"]) for s in spans]


def rates(ctx: Context) -> dict[str, Any]:
    """Our ``"20/s"`` pool beside Celery's ``rate_limit="20/s"``; the cost of a rate that
    never binds."""
    from pools.bench import stats, tasks
    from pools.bench.runs import plain_run, pooled_run
    from pools.bench.workers import PLAIN_QUEUE

    o = ctx.options
    n = o.rate_tasks
    out: dict[str, Any] = {
        "tasks": n,
        "limit": LIMIT,
        "workers": o.workers,
        "concurrency": o.concurrency,
        "pool": [],
        "celery": [],
    }
    pool = tasks.RATE_POOL
    set_rate(pool, LIMIT)
    log = AdmissionLog() if AdmissionLog.available() else None
    if log is not None:
        out["admissions"] = []
        log.__enter__()
    try:
        for rep in range(o.reps):
            tag = f"{rep + 1}/{o.reps}"
            if log is not None:
                log.clear()
            ours = pooled_run(
                ctx, f"rates: pool {LIMIT} {tag}", [(tasks.POOLED[pool], range(n))], [pool]
            )
            out["pool"].append(window_report(_starts(ours.spans), LIMIT_COUNT, LIMIT_SECONDS))
            if log is not None:
                admitted = log.read(pool)[1]
                out["admissions"].append(window_report(admitted, LIMIT_COUNT, LIMIT_SECONDS))
            theirs = plain_run(
                ctx,
                f"rates: Celery rate_limit={LIMIT} {tag}",
                tasks.celery_rated,
                n,
                lambda j: [j, 0.0],
                queue=PLAIN_QUEUE,
                workers=ctx.main,
            )
            out["celery"].append(window_report(_starts(theirs.spans), LIMIT_COUNT, LIMIT_SECONDS))
    finally:
        if log is not None:
            log.__exit__()
    for side in ("pool", "admissions", "celery"):
        reps = out.get(side)
        if reps is None:
            continue
        out[f"{side}_max_in_window"] = stats.summary([r["max_in_window"] for r in reps])
        out[f"{side}_achieved_per_s"] = stats.summary(
            [r["achieved_per_s"] for r in reps if r["achieved_per_s"] is not None]
        )
    out["cost"] = _cost(ctx)
    return out


#: A daily spend cap no run here can reach (slot-seconds): like a rate, it sends the pool's
#: admissions to the Python pass instead of the PostgreSQL fast path, without a rate.
SPEND_CAP_NEVER_BINDS = 1e12
#: The sides of the cost comparison: (label, rate, spend cap).
COST_SIDES: tuple[tuple[str, str | None, float | None], ...] = (
    ("none", None, None),
    ("never_binds", NEVER_BINDS, None),
    ("python_path", None, SPEND_CAP_NEVER_BINDS),
)


def _cost(ctx: Context) -> dict[str, Any]:
    """The W1 no-op loop with no rate, with :data:`NEVER_BINDS`, and (to tell the rate's own
    cost from that of the Python admission pass it takes) with a spend cap that never binds;
    in turns, so that a drift of the machine hits every side alike."""
    from pools.bench import stats, tasks
    from pools.bench.runs import pooled_run
    from pools.core import definitions

    o = ctx.options
    pool = tasks.W1_POOL
    reps: dict[str, list[float]] = {side: [] for side, _, _ in COST_SIDES}
    cpu: dict[str, list[dict[str, float]]] = {side: [] for side, _, _ in COST_SIDES}
    try:
        for rep in range(o.reps):
            for side, rate, cap in COST_SIDES:
                set_rate(pool, rate)
                definitions.update_pool(pool, spend_cap=cap)
                run = pooled_run(
                    ctx,
                    f"rates: cost, {side} {rep + 1}/{o.reps}",
                    [(tasks.POOLED[pool], range(o.tasks))],
                    [pool],
                )
                reps[side].append(run.throughput)
                if run.cpu_ms is not None:
                    cpu[side].append(run.cpu_ms)
    finally:
        set_rate(pool, None)
        definitions.update_pool(pool, spend_cap=None)
    out: dict[str, Any] = {
        "tasks": o.tasks,
        "rate": NEVER_BINDS,
        "spend_cap": SPEND_CAP_NEVER_BINDS,
        "reps": reps,
        **{f"{side}_per_s": stats.summary(v) for side, v in reps.items()},
        "cpu_ms_per_task": {side: stats.median_by_key(runs) for side, runs in cpu.items()},
    }
    none, rated = out["none_per_s"]["median"], out["never_binds_per_s"]["median"]
    out["ratio"] = rated / none if none else math.nan
    return out
