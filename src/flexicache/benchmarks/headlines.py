"""The headline numbers of a ``flexicache bench`` run, one sentence each, for the cases it ran.

Each sentence compares FlexiCache with the baseline measured in the same run (ratios between numbers of one run
only) and says what was measured and what was estimated. No thresholds: the targets a run is judged against live
in the project's issues, not in the package.
"""

from __future__ import annotations

from typing import Any

from flexicache.benchmarks.memory import prefill_text
from flexicache.benchmarks.rerank import rerank_summary
from flexicache.benchmarks.results import (
    batch_bound,
    case_rows,
    find,
    loop_for,
    memory_full,
    peak_of,
    size,
    step_full_depth,
)
from flexicache.benchmarks.suite import full_layers


def depth_text(row: dict[str, Any]) -> str:
    """``"32 layers"``, or ``"4 of 32 layers"`` for a run on fewer layers than the model has."""
    full = full_layers(row["model"])
    return f"{full} layers" if row["layers"] == full else f"{row['layers']} of {full} layers"


def rounds_text(row: dict[str, Any]) -> str:
    """``", rounds 11.9 / 11.7 ms"`` for a point measured in several rounds (the systems taking turns), else ``""``."""
    rounds = row.get("round_p50_ms") or []
    return f", rounds {' / '.join(f'{ms:.1f}' for ms in rounds)} ms" if len(rounds) > 1 else ""


def memory_point(row: dict[str, Any]) -> str:
    """``"flexicache-1024 at 32768 tokens x batch 8 (prefill in one forward, 32 layers)"``."""
    scaled = "" if row["layers"] == row["full_depth"]["layers"] else ", bytes scaled per layer"
    return (f"{row['system']} at {row['context']} tokens x batch {row.get('batch', 1)} (prefill in "
            f"{prefill_text(row.get('prefill_chunk', 0))}, {row['full_depth']['layers']} layers{scaled})")


def peak_text(row: dict[str, Any]) -> str:
    peak, estimated = peak_of(row)
    return "" if peak is None else f"; peak GPU memory {size(peak)}{' (estimate)' if estimated else ''}"


def memory_headlines(results: dict[str, Any]) -> list[str]:
    """At the run's longest context: each FlexiCache system's device bytes against the dense KV and its peak (with
    DynamicCache's peak where the run has it); DynamicCache's KV and peak when the run has no FlexiCache system."""
    rows = case_rows(results, "memory")
    if not rows:
        return []
    context = max(row["context"] for row in rows)
    rows = [row for row in rows if row["context"] == context]
    flexi = [row for row in rows if row["system"].startswith("flexicache")]
    out = []
    for row in flexi:
        dense, scale = row["dense_kv_bytes"], row["full_depth"]["layers"] / row["layers"]
        text = (f"{memory_point(row)}: device KV {size(memory_full(row)['device_kv_bytes'])} "
                f"({row['device_kv_bytes'] / dense:.1%} of the dense KV) + page min/max "
                f"{size(row['device_metadata_bytes'] * scale)} ({row['device_metadata_bytes'] / dense:.2%}) = "
                f"{row['device_fraction_of_dense']:.1%}{peak_text(row)}")
        dynamic = find(rows, system="dynamic", batch=row.get("batch", 1), model=row["model"],
                       context=row["context"])
        peak, (dynamic_peak, estimated) = peak_of(row)[0], peak_of(dynamic) if dynamic else (None, False)
        if peak and dynamic_peak:
            text += (f", {peak / dynamic_peak:.1%} of DynamicCache's {size(dynamic_peak)}"
                     f"{' (estimate)' if estimated else ''}")
        out.append(text)
    if not flexi:
        out += [f"{memory_point(row)}: KV {size(memory_full(row)['device_kv_bytes'])}{peak_text(row)}"
                for row in rows if row["system"] == "dynamic"]
    return out


def decode_headlines(results: dict[str, Any]) -> list[str]:
    """Per FlexiCache system and point: p50 step against DynamicCache's, p99/p50; the long/short context ratio."""
    rows = case_rows(results, "decode")
    out = []
    for row in rows:
        if not row["system"].startswith("flexicache"):
            continue
        text = (f"{row['system']}, {row['context']} tokens x batch {row['batch']} ({depth_text(row)}): "
                f"{row['step_ms_p50']:.2f} ms per decode step (p50{rounds_text(row)}), p99/p50 "
                f"{row['p99_over_p50']:.2f}, {row['tokens_per_s']:.0f} tokens/s")
        dynamic = find(rows, system="dynamic", model=row["model"], context=row["context"], batch=row["batch"])
        if dynamic:
            text += (f"; DynamicCache + sdpa {dynamic['step_ms_p50']:.1f} ms (p50{rounds_text(dynamic)}), "
                     f"{dynamic['tokens_per_s']:.0f} tokens/s: {dynamic['step_ms_p50'] / row['step_ms_p50']:.2f}x")
        full, _ = step_full_depth(results, row, row["batch"])
        if full and row["layers"] != full_layers(row["model"]):
            text += f" (full depth estimated {full['step_ms_p50']:.1f} ms)"
        out.append(text)
    for row in rows:
        shorter = [other for other in rows if other["system"] == row["system"] and other["batch"] == row["batch"]
                   and other["model"] == row["model"] and other["context"] < row["context"]]
        if row["system"].startswith("flexicache") and shorter:
            short = min(shorter, key=lambda other: other["context"])
            ratio = row["step_ms_p50"] / short["step_ms_p50"]
            out.append(f"{row['system']}'s step at {row['context']} tokens is {ratio:.2f}x "
                       f"its step at {short['context']} (batch {row['batch']}, p50)")
    return out


def attention_headlines(results: dict[str, Any]) -> list[str]:
    out = []
    for row in case_rows(results, "attention"):
        graphed = "flexicache_step_graph" if "flexicache_step_graph" in row else "flexicache"
        out.append(f"{row['layers']} attention layers, {row['context']} tokens x batch {row['batch']}, budget "
                   f"{row['budget']}: FlexiCache ({graphed}) {row[graphed]['layer_ms_p50']:.3f} ms per layer vs dense "
                   f"FlashInfer {row['dense_flashinfer']['layer_ms_p50']:.3f} ms: "
                   f"{row['speedup_vs_dense_flashinfer'][graphed]:.2f}x")
    return out


def rerank_headlines(results: dict[str, Any]) -> list[str]:
    summary = rerank_summary(case_rows(results, "rerank"))
    every, aware = summary.get("every_step"), summary.get("stability_aware")
    if every is None or aware is None:
        return []
    rows = f"{every['rows_vs_stability_aware']:.2f}x the reranked rows"
    if every.get("rerank_time_vs_stability_aware") is None:
        return [f"rerank time of every head every step against the stability-aware schedule: not measured (no mean "
                f"step times, or a stability-aware rerank time within noise); {rows}"]
    return [f"reranking every head every step costs {every['rerank_time_vs_stability_aware']:.2f}x the "
            f"stability-aware schedule's rerank time ({every['rerank_ms']:.3f} vs {aware['rerank_ms']:.3f} ms per step "
            f"over the no-rerank floor; {rows}; the paper reports 2.44x)"]


def throughput_headlines(results: dict[str, Any]) -> list[str]:
    rows = case_rows(results, "throughput")
    out = []
    for row in rows:
        dynamic = find(rows, system="dynamic", model=row["model"])
        if not row["system"].startswith("flexicache") or not dynamic or not row.get("largest_batch"):
            continue
        text = (f"{row['system']}: largest batch at {row['context']} tokens {row['largest_batch']} (bound: "
                f"{batch_bound(row)}; {full_layers(row['model'])} layers, "
                f"{'ran' if row.get('layers') == full_layers(row['model']) else 'estimated from measured bytes'}) "
                "vs DynamicCache's "
                f"{dynamic['largest_batch']}")
        if row.get("tokens_per_s") and dynamic.get("tokens_per_s"):
            text += (f"; tokens/s there {row['tokens_per_s']:.0f} vs {dynamic['tokens_per_s']:.0f} = "
                     f"{row['tokens_per_s'] / dynamic['tokens_per_s']:.2f}x, measured on {depth_text(row)}")
        out.append(text)
    return out


def mix_headlines(results: dict[str, Any]) -> list[str]:
    rows = case_rows(results, "mix")
    out = []
    for row in rows:
        dynamic = find(rows, system="dynamic", model=row["model"])
        if row["system"].startswith("flexicache") and dynamic:
            estimated = " (estimate: unmeasured steps at the batch median)" if (
                row["decode_steps_measured"] < row["decode_steps"]) else ""
            out.append(f"offline mix of {row['requests']} requests, {row['system']}: {row['requests_per_s']:.3f} vs "
                       f"DynamicCache's {dynamic['requests_per_s']:.3f} requests/s = "
                       f"{row['requests_per_s'] / dynamic['requests_per_s']:.2f}x on {depth_text(row)}{estimated}")
    return out


def loop_headlines(results: dict[str, Any]) -> list[str]:
    settings = results["settings"]
    loop = loop_for(results, settings["models"][0], settings["attention_batch"])
    if loop is None or not loop["consistent"]:
        return []
    return [f"transformers' decode loop (DynamicCache, {loop['context']} tokens, batch {loop['batch']}): "
            f"{loop['fixed_ms']:.1f} ms fixed + {loop['per_layer_ms']:.2f} ms per layer per step"]


HEADLINES = {"memory": memory_headlines, "decode": decode_headlines, "attention": attention_headlines,
             "rerank": rerank_headlines, "throughput": throughput_headlines, "mix": mix_headlines}


def headlines(results: dict[str, Any], cases: list[str] | None = None) -> list[str]:
    """The headline sentences of ``results`` for ``cases`` (default: every case the run has), then the loop's cost."""
    ran = [case for case in HEADLINES if case in results.get("cases", {}) and (cases is None or case in cases)]
    out = [line for case in ran for line in HEADLINES[case](results)]
    if cases is None or "decode" in cases:
        out += loop_headlines(results)
    return out
