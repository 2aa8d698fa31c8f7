"""PNG plots of a result (matplotlib, Agg backend; the ``bench`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def draw(results: dict[str, Any], out: Path) -> list[Path]:
    """Draw whatever the result holds; returns the PNG files written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the bench extra is not installed: the JSON and table still exist
        return []
    files: list[Path] = []
    for name, fn in (
        ("w1-throughput.png", _w1),
        ("w2-handoff.png", _w2),
        ("w3-depth.png", _w3),
        ("w5-recipe.png", _w5),
    ):
        data = results.get(name[:2].upper())
        if not isinstance(data, dict) or "error" in data or "skipped" in data:
            continue
        fig = fn(plt, data)
        if fig is None:
            continue
        path = out / name
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        files.append(path)
    return files


def _errbar(ax: Any, xs: list[float], summaries: list[dict[str, float]], **kw: Any) -> None:
    med = [s["median"] for s in summaries]
    lo = [s["median"] - s["min"] for s in summaries]
    hi = [s["max"] - s["median"] for s in summaries]
    ax.bar(xs, med, yerr=[lo, hi], capsize=4, **kw)


def _w1(plt: Any, d: dict[str, Any]) -> Any:
    bodies = [b for b in ("no-op", "20 ms") if b in d]
    if not bodies:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.6))
    xs = list(range(len(bodies)))
    _errbar(
        ax, [x - 0.2 for x in xs], [d[b]["plain"] for b in bodies], width=0.4, label="plain Celery"
    )
    _errbar(
        ax,
        [x + 0.2 for x in xs],
        [d[b]["pooled"] for b in bodies],
        width=0.4,
        label=f"pooled ({d['slots']} slots)",
    )
    ax.set_xticks(xs, [f"{b} body" for b in bodies])
    ax.set_ylabel("tasks/s (median, min-max)")
    ax.set_title("W1 throughput with a backlog")
    ax.legend()
    return fig


def _w2(plt: Any, d: dict[str, Any]) -> Any:
    samples = d.get("samples") or {}
    if not samples:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    labels = {
        "settle_to_start": "pooled: settle -> next body start",
        "end_to_start": "pooled: body end -> next body start",
        "floor_end_to_start": "plain Celery 1x1: body end -> next start",
    }
    for key, label in labels.items():
        values = sorted(v * 1000 for v in samples.get(key, []))
        if values:
            ys = [(n + 1) / len(values) for n in range(len(values))]
            ax.step(values, ys, where="post", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("gap (ms, log scale)")
    ax.set_ylabel("fraction of hand-offs")
    ax.set_title(f"W2 hand-off, 1 slot, {d['tasks']} tasks (last repetition)")
    ax.legend(fontsize=8)
    return fig


def _w3(plt: Any, d: dict[str, Any]) -> Any:
    depths = sorted((int(k), v) for k, v in (d.get("depths") or {}).items())
    if not depths:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.6))
    xs = [k for k, _ in depths]
    med = [v["median"] for _, v in depths]
    ax.errorbar(
        xs,
        med,
        yerr=[
            [m - v["min"] for m, (_, v) in zip(med, depths, strict=True)],
            [v["max"] - m for m, (_, v) in zip(med, depths, strict=True)],
        ],
        marker="o",
        capsize=4,
    )
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("entries already waiting in the pool")
    ax.set_ylabel("tasks/s (median, min-max)")
    ax.set_title(f"W3 admission+settle with a deep line ({d['tasks']} tasks timed)")
    return fig


def _w5(plt: Any, d: dict[str, Any]) -> Any:
    bodies = [b for b in ("no-op", "20 ms") if b in d]
    if not bodies:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    panels = (
        ("throughput", "tasks/s", 1.0),
        ("handoff_p99", "hand-off p99 (ms)", 1000.0),
        ("retries", "wasted retries", 1.0),
    )
    for ax, (key, label, scale) in zip(axes, panels, strict=True):
        xs = list(range(len(bodies)))
        for offset, side in ((-0.2, "recipe"), (0.2, "pools")):
            sums = [{k: v * scale for k, v in d[b][side][key].items()} for b in bodies]
            _errbar(ax, [x + offset for x in xs], sums, width=0.4, label=side)
        ax.set_xticks(xs, bodies)
        ax.set_title(label)
    axes[0].legend()
    fig.suptitle(f"W5 pools vs the Redis semaphore + retry recipe (limit {d['limit']})")
    return fig
