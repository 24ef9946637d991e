"""PNG plots of a ``flexicache bench`` run (matplotlib, Agg): memory vs context, speedup vs batch, rerank ablation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flexicache.benchmarks.rerank import rerank_summary
from flexicache.benchmarks.results import GIB, case_rows, find, memory_full, peak_of
from flexicache.plotting import pyplot


def tokens_label(count: int) -> str:
    return f"{count // 1024}k" if count >= 1024 and count % 1024 == 0 else str(count)


def log2_axis(ax: Any, values: list[int], label: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(values, [tokens_label(value) for value in values])
    ax.minorticks_off()
    ax.set_xlabel(label)


def series_of(row: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """A plot line's label: the row's system, prefixed with its model shape when the run measured several."""
    several = len({other["model"] for other in rows}) > 1
    return f"{row['model']} {row['system']}" if several else row["system"]


def plot_memory(rows: list[dict[str, Any]], path: Path) -> None:
    """Full-depth device bytes (KV + metadata) and peak (CUDA) or reserved device bytes vs context, per system."""
    plt = pyplot()
    fulls = [memory_full(row) for row in rows]  # dynamic-offload: one resident layer at any depth
    has_peak = any("peak_bytes" in full for full in fulls)
    estimated = any(peak_of(row)[1] for row in rows)  # fewer layers ran than the model has
    peak_title = "peak device memory" + (" (estimate)" if estimated else "")
    right_key, right_title = ("peak_bytes", peak_title) if has_peak else ("device_reserved_bytes",
                                                                          "device bytes reserved")
    batches = "/".join(str(batch) for batch in sorted({row.get("batch", 1) for row in rows}))
    unit, scale = ("GiB", GIB) if max(full["device_bytes"] for full in fulls) >= GIB else ("MiB", 2**20)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for series in dict.fromkeys(series_of(row, rows) for row in rows):
        points = sorted(((row["context"], full) for row, full in zip(rows, fulls) if series_of(row, rows) == series),
                        key=lambda point: point[0])
        contexts = [context for context, _ in points]
        axes[0].plot(contexts, [full["device_bytes"] / scale for _, full in points], marker="o", label=series)
        axes[1].plot(contexts, [full.get(right_key, 0) / scale for _, full in points], marker="o", label=series)
    layers = rows[0]["full_depth"]["layers"]
    for ax, title in zip(axes, ("device KV + page metadata", right_title)):
        log2_axis(ax, sorted({row["context"] for row in rows}), f"context (tokens), batch {batches}")
        ax.set_ylabel(unit)
        ax.set_title(f"{title}, {layers} layers", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_speedup(rows: list[dict[str, Any]], path: Path) -> None:
    """Step-time speedup over DynamicCache vs batch size, one panel per context."""
    plt = pyplot()
    contexts = sorted({row["context"] for row in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(4.2 * len(contexts), 3.6), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        for series in dict.fromkeys(series_of(row, rows) for row in rows if row["system"] != "dynamic"):
            points = []
            for row in rows:
                dyn = find(rows, system="dynamic", context=context, batch=row["batch"], model=row["model"])
                if series_of(row, rows) == series and row["context"] == context and dyn:
                    points.append((row["batch"], dyn["step_ms_p50"] / row["step_ms_p50"]))
            if points:
                points.sort()
                ax.plot([b for b, _ in points], [v for _, v in points], marker="o", label=series)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        log2_axis(ax, sorted({row["batch"] for row in rows}), "batch")
        ax.set_ylabel("DynamicCache step / system step")
        ax.set_title(f"context {tokens_label(context)} ({rows[0]['layers']} layers, measured)", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_rerank(rows: list[dict[str, Any]], path: Path) -> None:
    """Step time per rerank schedule (mean when recorded, else p50), annotated with the rerank time (mean step over
    no_rerank's mean) or, without means, the p50 excess (labelled so), and reranked rows per step."""
    plt = pyplot()
    summary = rerank_summary(rows)
    names = list(summary)
    has_mean = all(summary[name]["step_ms_mean"] is not None for name in names)
    key = "step_ms_mean" if has_mean else "step_ms_p50"
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    bars = ax.bar(names, [summary[name][key] for name in names], color="tab:blue")
    for bar, name in zip(bars, names):
        item = summary[name]
        if name == "quest_like":
            label = "no host tier"
        elif has_mean:
            label = f"rerank {item['rerank_ms']:.2f} ms/step"
        else:
            label = f"p50 - floor p50 {item['p50_excess_ms']:.2f} ms\n(not rerank time)"
        ax.annotate(f"{label}\n{item['reranked_rows_per_step']:.0f} rows/step",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7)
    first = rows[0]
    ax.set_ylabel(f"decode step ms, {'mean' if has_mean else 'p50'} (attention layers)")
    ax.set_title(f"rerank ablation: {first['layers']} layers, batch {first['batch']}, context {first['context']}, "
                 f"budget {first['budget']}" + ("" if has_mean else "\n(p50 only: rerank time not measured)"),
                 fontsize=9)
    ax.margins(y=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def has_dynamic(rows: list[dict[str, Any]]) -> bool:
    """Whether ``rows`` hold DynamicCache's, which a speedup plot divides by."""
    return any(row["system"] == "dynamic" for row in rows)


# case: (file name, plot, whether its rows can be plotted)
PLOTS = {"memory": ("memory.png", plot_memory, bool), "decode": ("decode_speedup.png", plot_speedup, has_dynamic),
         "rerank": ("rerank.png", plot_rerank, bool)}


def write_plots(results: dict[str, Any], out: Path) -> list[str]:
    """Write the plots whose case has rows to plot; returns their file names (none without matplotlib)."""
    try:
        pyplot()
    except ImportError:
        return []
    written = []
    for case, (name, plot, plottable) in PLOTS.items():
        rows = case_rows(results, case)
        if plottable(rows):
            plot(rows, out / name)
            written.append(name)
    return written
