"""The benchmark's outputs: a text table, ``bench.json`` and PNG plots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

#: ``(workload, figure, value, unit, target, met)``: ``met`` is None where there is no target.
Row = tuple[str, str, dict[str, float] | float | None, str, str, bool | None]

KIB = 1024.0
MIB = 1024.0 * 1024.0


def _fmt(value: float | None, unit: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if unit == "ms":
        return f"{value * 1000:.1f}"
    if unit == "s":
        return f"{value:.1f}"
    if unit in ("x",):
        return f"{value:.2f}"
    if unit == "KiB":
        return f"{value / KIB:.2f}"
    if unit == "MiB":
        return f"{value / MIB:.1f}"
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}"


def _num(value: Any, key: str = "median") -> float | None:
    """The figure a target is judged on: ``value[key]`` of a summary, or the number itself."""
    if isinstance(value, dict):
        value = value.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return float(value)


def _at_most(value: Any, limit: float | None, key: str = "median") -> bool | None:
    v = _num(value, key)
    return None if v is None or limit is None else v <= limit


def _at_least(value: Any, limit: float, key: str = "median") -> bool | None:
    v = _num(value, key)
    return None if v is None else v >= limit


def _lag_rows(body: str, d: dict[str, Any]) -> list[Row]:
    """Release -> first body start, outside the throughput clock (absent in older results)."""
    return [
        ("W1", f"{body}: first body after the release, {side}", d[key], "ms", "", None)
        for side, key in (("pooled", "lag_pooled"), ("plain", "lag_plain"))
        if key in d
    ]


#: Table labels of :data:`pools.bench.stats.STAGES`.
STAGE_LABELS = {
    "end_to_settle": "pooled body end -> settle call",
    "admitted_to_start": "pooled admission -> start call",
    "start_to_body": "pooled start call -> body",
}


def _stage_rows(workload: str, prefix: str, stages: dict[str, Any]) -> list[Row]:
    """Where a pooled task's hand-off time goes (absent in older results)."""
    return [
        (workload, f"{prefix}{STAGE_LABELS[name]} {q}", stages[name][q], "ms", "", None)
        for name in STAGE_LABELS
        if name in stages
        for q in ("p50", "p99")
    ]


def _rows(r: dict[str, Any]) -> list[Row]:
    """Every figure of the table; a target is judged on the median of the repetitions, except
    where every repetition must meet it (zero retries, zero inversions, peak, killed holder:
    judged on the max)."""
    rows: list[Row] = []
    w1 = r.get("W1") or {}
    for body, low in (("no-op", 0.5), ("20 ms", 0.9)):
        d = w1.get(body)
        if not d:
            continue
        rows += [
            ("W1", f"{body}: pooled tasks/s", d["pooled"], "tasks/s", "", None),
            ("W1", f"{body}: plain Celery tasks/s", d["plain"], "tasks/s", "", None),
            (
                "W1",
                f"{body}: pooled / plain",
                d["ratio"],
                "x",
                f">= {low:.2f}",
                _at_least(d["ratio"], low),
            ),
            (
                "W1",
                f"{body}: pooled submit (apply_async/s)",
                d["submit_pooled"],
                "calls/s",
                "",
                None,
            ),
            ("W1", f"{body}: plain submit (apply_async/s)", d["submit_plain"], "calls/s", "", None),
            *_lag_rows(body, d),
            *_stage_rows("W1", f"{body}: ", d.get("stages") or {}),
            *_cpu_rows(body, d.get("cpu_ms_per_task") or {}),
            *_wal_rows(body, d.get("wal_bytes")),
        ]
    w2 = r.get("W2") or {}
    if "settle_to_start" in w2:
        for key, label, targets in (
            ("settle_to_start", "pooled settle -> next start", {"p50": 0.010, "p99": 0.040}),
            ("end_to_start", "pooled body end -> next start", {}),
            ("floor_end_to_start", "plain 1x1 end -> next start (floor)", {}),
        ):
            for q in ("p50", "p95", "p99"):
                limit = targets.get(q)
                rows.append(
                    (
                        "W2",
                        f"{label} {q}",
                        w2[key][q],
                        "ms",
                        f"<= {limit * 1000:.0f}" if limit else "",
                        _at_most(w2[key][q], limit) if limit else None,
                    )
                )
        rows += _stage_rows("W2", "", w2.get("stages") or {})
    w3 = r.get("W3") or {}
    for depth, d in (w3.get("depths") or {}).items():
        rows.append(("W3", f"tasks/s with {int(depth):,} waiting", d, "tasks/s", "", None))
    if "ratio" in w3:
        rows.append(
            (
                "W3",
                f"ratio {w3['ratio_of']}",
                w3["ratio"],
                "x",
                ">= 0.80",
                _at_least(w3["ratio"], 0.8),
            )
        )
    memory = w3.get("memory")
    if memory:
        args_bytes = float(memory.get("args_bytes", 0))
        rows.append(
            (
                "memory",
                "DB bytes per waiting entry",
                memory["total_per_entry"],
                "KiB",
                "<= 2 KiB + args",
                _at_most(memory["total_per_entry"], 2 * KIB + args_bytes),
            )
        )
    w4 = r.get("W4") or {}
    for key, label in (("many", "100 pools, tasks/s"), ("multi", "multi-pool mix, tasks/s")):
        if key in w4:
            rows.append(("W4", label, w4[key], "tasks/s", "", None))
    rows += _w5_rows(r.get("W5") or {})
    rows += _rates_rows(r.get("rates") or {})
    mem = r.get("memory") or {}
    if "child_overhead" in mem:
        rows += [
            ("memory", "pool process RSS, plain", mem["plain"]["child_mean"], "MiB", "", None),
            ("memory", "pool process RSS, pooled", mem["pooled"]["child_mean"], "MiB", "", None),
            (
                "memory",
                "RSS overhead per pool process",
                mem["child_overhead"],
                "MiB",
                "<= 10 MiB",
                _at_most(mem["child_overhead"], 10 * MIB),
            ),
        ]
    return rows


def _rates_rows(rates: dict[str, Any]) -> list[Row]:
    """Our rate beside Celery's per-worker ``rate_limit``; the cost of a rate that never binds."""
    if "pool_max_in_window" not in rates:
        return []
    limit = rates["limit"]
    count = int(limit.split("/")[0])
    rows: list[Row] = []
    if "admissions_max_in_window" in rates:
        rows.append(
            (
                "rates",
                f"pool {limit}: most admissions in any 1 s (db clock)",
                rates["admissions_max_in_window"],
                "starts",
                f"<= {count}",
                _at_most(rates["admissions_max_in_window"], count, "max"),
            )
        )
    rows += [
        (
            "rates",
            f"pool {limit}: most body starts in any 1 s",
            rates["pool_max_in_window"],
            "starts",
            "",
            None,
        ),
        (
            "rates",
            f"pool {limit}: achieved starts/s",
            rates["pool_achieved_per_s"],
            "tasks/s",
            f">= {0.9 * count:g}",
            _at_least(rates["pool_achieved_per_s"], 0.9 * count, "min"),
        ),
        (
            "rates",
            f"Celery rate_limit={limit}: most starts in any 1 s",
            rates["celery_max_in_window"],
            "starts",
            "",
            None,
        ),
        (
            "rates",
            f"Celery rate_limit={limit}: achieved starts/s",
            rates["celery_achieved_per_s"],
            "tasks/s",
            "",
            None,
        ),
    ]
    cost = rates.get("cost") or {}
    if "none_per_s" in cost:
        rows += [
            ("rates", "no-op tasks/s, no rate", cost["none_per_s"], "tasks/s", "", None),
            (
                "rates",
                f"no-op tasks/s, rate {cost['rate']} (never binds)",
                cost["never_binds_per_s"],
                "tasks/s",
                "",
                None,
            ),
        ]
        if "python_path_per_s" in cost:
            rows.append(
                (
                    "rates",
                    "no-op tasks/s, spend cap (never binds), no rate",
                    cost["python_path_per_s"],
                    "tasks/s",
                    "",
                    None,
                )
            )
    return rows


def _w5_rows(w5: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    limit = d_limit(w5)
    for body in ("no-op", "20 ms"):
        d = w5.get(body)
        if not d:
            continue
        recipe_p99 = _num(d["recipe"]["handoff_p99"])
        for side in ("pools", "recipe"):
            s = d[side]
            ours = side == "pools"
            rows += [
                ("W5", f"{body} {side}: tasks/s", s["throughput"], "tasks/s", "", None),
                ("W5", f"{body} {side}: hand-off p50", s["handoff_p50"], "ms", "", None),
                (
                    "W5",
                    f"{body} {side}: hand-off p99",
                    s["handoff_p99"],
                    "ms",
                    "<= recipe" if ours else "",
                    _at_most(s["handoff_p99"], recipe_p99) if ours else None,
                ),
                (
                    "W5",
                    f"{body} {side}: wasted retries",
                    s["retries"],
                    "",
                    "0" if ours else "",
                    _at_most(s["retries"], 0, "max") if ours else None,
                ),
                (
                    "W5",
                    f"{body} {side}: priority inversions",
                    s["inversions"],
                    "",
                    "0" if ours else "",
                    _at_most(s["inversions"], 0, "max") if ours else None,
                ),
                (
                    "W5",
                    f"{body} {side}: peak running / limit",
                    float(s["peak"]),
                    "",
                    f"<= {limit}",
                    _at_most(float(s["peak"]), limit),
                ),
            ]
    kill = w5.get("kill")
    if kill:
        lease = float(kill["lease_seconds"])
        ttl = float(kill.get("recipe_ttl", w5.get("ttl", 0)))
        rows += [
            (
                "W5",
                "killed holder: slot back after (pools)",
                kill["pools"],
                "s",
                f"<= lease {lease:g} s (recipe TTL {ttl:g} s)",
                _at_most(kill["pools"], lease, "max"),
            ),
            (
                "W5",
                f"killed holder: slot back after (recipe, TTL {ttl:g} s)",
                kill["recipe"],
                "s",
                "",
                None,
            ),
        ]
    return rows


def d_limit(w5: dict[str, Any]) -> int:
    """The W5 limit (slots of the pool = semaphore size)."""
    return int(w5.get("limit", 0))


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every figure with a target, and whether it was met (None: not measured)."""
    return [
        {"workload": w, "figure": label, "value": value, "unit": unit, "target": t, "met": met}
        for w, label, value, unit, t, met in _rows(results)
        if t
    ]


def _met(met: bool | None, target: str) -> str:
    if not target:
        return ""
    if met is None:
        return "?"  # not measured (a failed workload, nan)
    return "yes" if met else "NO"


def table(results: dict[str, Any]) -> str:
    """The result table: one row per figure, median [min - max] of the repetitions."""
    lines = []
    if results.get("command"):
        preset = (results.get("options") or {}).get("preset", "default")
        sizes = f"  (sizes: the {preset} preset)" if preset != "default" else ""
        lines.append(f"Options: {results['command']}{sizes}\n")
    lines += [
        f"{'':6} {'figure':<50} {'median':>10} {'min':>10} {'max':>10}  {'unit':<8} "
        f"{'target':<32} met?",
        "-" * 136,
    ]
    for workload, label, value, unit, target, met in _rows(results):
        if isinstance(value, dict):
            med, lo, hi = value.get("median"), value.get("min"), value.get("max")
        else:
            med, lo, hi = value, None, None
        lines.append(
            f"{workload:<6} {label:<50} {_fmt(med, unit):>10} {_fmt(lo, unit):>10} "
            f"{_fmt(hi, unit):>10}  {unit:<8} {target:<32} {_met(met, target)}".rstrip()
        )
    for name, value in results.items():
        if isinstance(value, dict) and ("error" in value or "skipped" in value):
            lines.append(f"{name:<6} {value.get('error') or value.get('skipped')}")
    meta = results.get("meta") or {}
    if meta:
        db = meta.get("database", {})
        took = meta.get("seconds")
        lines.append(
            f"\n{meta.get('workers')} workers x {meta.get('concurrency')} prefork processes; "
            f"{db.get('vendor')} ({db.get('version', '')[:30]}), broker {meta.get('broker')}, "
            f"results {meta.get('result_backend')}; {meta.get('reps')} repetitions; "
            f"lease {meta.get('lease_seconds')} s; "
            f"load average before {meta.get('loadavg_before')}, after {meta.get('loadavg_after')}"
            + _cpu_line(meta.get("cpu"))
            + (f"; took {took / 60:.1f} min" if isinstance(took, int | float) else "")
        )
        if db.get("autovacuum") is False:
            lines.append(
                "autovacuum is off on this server: the benchmark vacuums the queue tables "
                "before each pooled repetition (outside the clock), as autovacuum would."
            )
    return "\n".join(lines)


def _cpu_rows(body: str, cpu: dict[str, Any]) -> list[Row]:
    """CPU per task of each process group: pooled in the value column, plain in the label."""
    plain, pooled = cpu.get("plain"), cpu.get("pooled")
    if not plain or not pooled:
        return []
    return [
        (
            "W1",
            f"{body}: CPU/task {group} (plain {plain[group]:.2f})",
            pooled[group],
            "ms CPU",
            "",
            None,
        )
        for group in pooled
    ]


def _wal_rows(body: str, wal: Any) -> list[Row]:
    """PostgreSQL write-ahead log per pooled task (no row on other databases)."""
    if _num(wal) is None:
        return []
    return [("W1", f"{body}: PostgreSQL WAL per pooled task", wal, "bytes", "", None)]


def _cpu_line(cpu: Any) -> str:
    if not isinstance(cpu, dict):
        return ""
    return (
        f"; CPU during the run {cpu.get('busy_percent')}% busy, "
        f"{cpu.get('steal_percent')}% stolen by other guests"
    )


def _clean(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def write(results: dict[str, Any], out: Path, *, plots: bool = True) -> list[Path]:
    """Write ``bench.json`` and (with matplotlib) the plots into ``out``; returns the files."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench.json"
    path.write_text(json.dumps(_clean(results), indent=1, default=str) + "\n")
    files = [path]
    if plots:
        from pools.bench import plots as plotting

        files += plotting.draw(results, out)
    return files
