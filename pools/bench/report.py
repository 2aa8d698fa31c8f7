"""The benchmark's outputs: a text table, ``bench.json`` and PNG plots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

Row = tuple[str, str, dict[str, float] | float | None, str, str]

KIB = 1024.0
MIB = 1024.0 * 1024.0


def _fmt(value: float, unit: str) -> str:
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


def _rows(r: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    w1 = r.get("W1") or {}
    for body, target in (("no-op", ">= 0.50"), ("20 ms", ">= 0.90")):
        d = w1.get(body)
        if not d:
            continue
        rows += [
            ("W1", f"{body}: pooled tasks/s", d["pooled"], "tasks/s", ""),
            ("W1", f"{body}: plain Celery tasks/s", d["plain"], "tasks/s", ""),
            ("W1", f"{body}: pooled / plain", d["ratio"], "x", target),
            ("W1", f"{body}: pooled submit (apply_async/s)", d["submit_pooled"], "calls/s", ""),
            ("W1", f"{body}: plain submit (apply_async/s)", d["submit_plain"], "calls/s", ""),
        ]
    w2 = r.get("W2") or {}
    if "settle_to_start" in w2:
        for key, label, targets in (
            ("settle_to_start", "pooled settle -> next start", {"p50": "<= 10", "p99": "<= 40"}),
            ("end_to_start", "pooled body end -> next start", {}),
            ("floor_end_to_start", "plain 1x1 end -> next start (floor)", {}),
        ):
            for q in ("p50", "p95", "p99"):
                rows.append(("W2", f"{label} {q}", w2[key][q], "ms", targets.get(q, "")))
    w3 = r.get("W3") or {}
    for depth, d in (w3.get("depths") or {}).items():
        rows.append(("W3", f"tasks/s with {int(depth):,} waiting", d, "tasks/s", ""))
    if "ratio" in w3:
        rows.append(("W3", f"ratio {w3['ratio_of']}", w3["ratio"], "x", ">= 0.80"))
    if w3.get("memory"):
        rows.append(
            (
                "memory",
                "DB bytes per waiting entry",
                w3["memory"]["total_per_entry"],
                "KiB",
                "<= 2 KiB + args",
            )
        )
    w4 = r.get("W4") or {}
    for key, label in (("many", "100 pools, tasks/s"), ("multi", "multi-pool mix, tasks/s")):
        if key in w4:
            rows.append(("W4", label, w4[key], "tasks/s", ""))
    w5 = r.get("W5") or {}
    for body in ("no-op", "20 ms"):
        d = w5.get(body)
        if not d:
            continue
        for side in ("pools", "recipe"):
            s = d[side]
            rows += [
                ("W5", f"{body} {side}: tasks/s", s["throughput"], "tasks/s", ""),
                ("W5", f"{body} {side}: hand-off p50", s["handoff_p50"], "ms", ""),
                (
                    "W5",
                    f"{body} {side}: hand-off p99",
                    s["handoff_p99"],
                    "ms",
                    "<= recipe" if side == "pools" else "",
                ),
                (
                    "W5",
                    f"{body} {side}: wasted retries",
                    s["retries"],
                    "",
                    "0" if side == "pools" else "",
                ),
                (
                    "W5",
                    f"{body} {side}: priority inversions",
                    s["inversions"],
                    "",
                    "0" if side == "pools" else "",
                ),
                (
                    "W5",
                    f"{body} {side}: peak running / limit",
                    float(s["peak"]),
                    "",
                    f"<= {d_limit(w5)}",
                ),
            ]
    kill = w5.get("kill")
    if kill:
        rows.append(
            (
                "W5",
                "killed holder: slot back after (pools)",
                kill["pools"],
                "s",
                f"<= lease {kill['lease_seconds']:.0f} s",
            )
        )
        rows.append(
            (
                "W5",
                "killed holder: slot back after (recipe)",
                kill["recipe"],
                "s",
                f"TTL {w5.get('ttl', 0):.0f} s",
            )
        )
    mem = r.get("memory") or {}
    if "child_overhead" in mem:
        rows += [
            ("memory", "pool process RSS, plain", mem["plain"]["child_mean"], "MiB", ""),
            ("memory", "pool process RSS, pooled", mem["pooled"]["child_mean"], "MiB", ""),
            ("memory", "RSS overhead per pool process", mem["child_overhead"], "MiB", "<= 10 MiB"),
        ]
    return rows


def d_limit(w5: dict[str, Any]) -> int:
    """The W5 limit (slots of the pool = semaphore size)."""
    return int(w5.get("limit", 0))


def table(results: dict[str, Any]) -> str:
    """The result table: one row per figure, median [min - max] of the repetitions."""
    lines = [
        f"{'':6} {'figure':<44} {'median':>10} {'min':>10} {'max':>10}  {'unit':<8} target",
        "-" * 104,
    ]
    for workload, label, value, unit, target in _rows(results):
        if isinstance(value, dict):
            med, lo, hi = value.get("median"), value.get("min"), value.get("max")
        else:
            med, lo, hi = value, None, None
        lines.append(
            f"{workload:<6} {label:<44} {_fmt(med, unit):>10} {_fmt(lo, unit):>10} "  # type: ignore[arg-type]
            f"{_fmt(hi, unit):>10}  {unit:<8} {target}"  # type: ignore[arg-type]
        )
    for name, value in results.items():
        if isinstance(value, dict) and ("error" in value or "skipped" in value):
            lines.append(f"{name:<6} {value.get('error') or value.get('skipped')}")
    meta = results.get("meta") or {}
    if meta:
        db = meta.get("database", {})
        lines.append(
            f"\n{meta.get('workers')} workers x {meta.get('concurrency')} prefork processes; "
            f"{db.get('vendor')} ({db.get('version', '')[:30]}), broker {meta.get('broker')}, "
            f"results {meta.get('result_backend')}; {meta.get('reps')} repetitions; "
            f"load average before {meta.get('loadavg_before')}, after {meta.get('loadavg_after')}"
        )
    return "\n".join(lines)


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
