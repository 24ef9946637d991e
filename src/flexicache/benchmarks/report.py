"""Markdown report of a ``flexicache bench`` run (from its ``bench.json`` alone), targets included."""

from __future__ import annotations

from typing import Any

from flexicache.benchmarks.rerank import rerank_summary

GIB = 2**30


def fmt(value: Any, digits: int = 2, scale: float = 1.0, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value / scale:.{digits}f}{suffix}"


def size(value: float | None) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1 (``-`` for ``None``)."""
    if value is None:
        return "-"
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def case_rows(results: dict[str, Any], case: str) -> list[dict[str, Any]]:
    return results.get("cases", {}).get(case, {}).get("rows", [])


def find(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    return next((row for row in rows if all(row.get(key) == value for key, value in match.items())), None)


def full_or_measured(row: dict[str, Any], key: str) -> float | None:
    """The full-depth estimate of ``key`` when the row has one, else the measured value."""
    return (row.get("full_depth") or {}).get(key, row.get(key))


# ------------------------------------------------------------------------------------------------------- targets


def targets(results: dict[str, Any]) -> list[dict[str, str]]:
    """Issue 6's targets for the run's first model at its long context, batch and budget (32k, 8, 1024 on the GPU):
    value and status. A step-time ratio is judged on the full-depth estimates when the run has them."""
    settings = results["settings"]
    context, batch, budget = settings["attention_context"], settings["attention_batch"], settings["budget"]
    system, model = f"flexicache-{budget}", settings["models"][0]
    out = []

    def rows_of(case: str) -> list[dict[str, Any]]:
        return [row for row in case_rows(results, case) if row.get("model") == model]

    def add(name: str, value: str | None, met: bool | None) -> None:
        status = "pending" if value is None else ("reported" if met is None else ("met" if met else "NOT met"))
        out.append({"target": name, "value": value or "no data in this run", "status": status})

    memory = rows_of("memory")
    fc, dyn = find(memory, system=system, context=context), find(memory, system="dynamic", context=context)
    if fc and dyn:
        share = (fc["device_kv_bytes"] + fc["device_metadata_bytes"]) / dyn["device_kv_bytes"]
        add(f"device KV <= 30% of DynamicCache at {context} tokens, budget {budget}",
            f"{share:.1%} with page min/max ({fc['device_kv_bytes'] / dyn['device_kv_bytes']:.1%} pages only, "
            f"{fc['device_reserved_bytes'] / dyn['device_kv_bytes']:.1%} reserved)", share <= 0.30)
    else:
        add(f"device KV <= 30% of DynamicCache at {context} tokens, budget {budget}", None, None)

    layer = rows_of("attention")
    speedup = layer[0]["speedup_vs_dense_flashinfer"]["flexicache"] if layer else None
    add(f"attention-layer speedup >= 4x vs dense FlashInfer at {context}, batch {batch}",
        None if speedup is None else f"{speedup:.2f}x", None if speedup is None else speedup >= 4)

    decode = rows_of("decode")
    long_row = find(decode, system=system, context=context, batch=batch)
    short_row = find(decode, system=system, context=settings["loop_context"], batch=batch)
    if long_row and short_row:
        ratio = long_row["step_ms_p50"] / short_row["step_ms_p50"]
        value = (f"{ratio:.2f}x measured ({long_row['step_ms_p50']:.1f} vs {short_row['step_ms_p50']:.1f} ms, "
                 f"{long_row['layers']} layers)")
        if long_row.get("full_depth") and short_row.get("full_depth"):
            ratio = long_row["full_depth"]["step_ms_p50"] / short_row["full_depth"]["step_ms_p50"]
            value += f"; {ratio:.2f}x full-depth estimate"
        add(f"generate step at {context}, batch {batch} <= 1.2x the same loop at {settings['loop_context']}",
            value, ratio <= 1.2)
    else:
        add(f"generate step at {context}, batch {batch} <= 1.2x the same loop at {settings['loop_context']}",
            None, None)

    throughput = rows_of("throughput")
    fc, dyn = find(throughput, system=system), find(throughput, system="dynamic")
    if fc and dyn and dyn.get("largest_batch"):
        ratio = fc["largest_batch"] / dyn["largest_batch"]
        add(f"largest batch at {settings['throughput_context']} >= 1.5x DynamicCache's",
            f"{fc['largest_batch']} vs {dyn['largest_batch']} = {ratio:.2f}x (bound: {fc['bound']})", ratio >= 1.5)
        fc_tps, dyn_tps = full_or_measured(fc, "tokens_per_s"), full_or_measured(dyn, "tokens_per_s")
        if fc_tps and dyn_tps:
            tag = "full-depth estimate" if fc.get("full_depth") else "measured"
            add("tokens/s at the largest batch >= 2x DynamicCache's at its largest",
                f"{fc_tps:.0f} vs {dyn_tps:.0f} tok/s = {fc_tps / dyn_tps:.2f}x ({tag})", fc_tps / dyn_tps >= 2)
        else:
            add("tokens/s at the largest batch >= 2x DynamicCache's at its largest", None, None)
    else:
        add(f"largest batch at {settings['throughput_context']} >= 1.5x DynamicCache's", None, None)
        add("tokens/s at the largest batch >= 2x DynamicCache's at its largest", None, None)

    add(f"p99/p50 step time <= 1.3 ({system}, {context}, batch {batch})",
        None if long_row is None else f"{long_row['p99_over_p50']:.2f} (p99 {long_row['step_ms_p99']:.1f} ms)",
        None if long_row is None else long_row["p99_over_p50"] <= 1.3)

    loop = find(results.get("loop", []), batch=batch, model=model)
    add(f"fixed cost of the transformers loop (DynamicCache, {settings['loop_context']} tokens, batch {batch})",
        None if loop is None else f"{loop['step_ms']:.1f} ms/step on {loop['layers']} layers = "
        f"{loop['fixed_ms']:.1f} ms fixed + {loop['per_layer_ms']:.2f} ms/layer; full depth "
        f"{loop['full_depth_step_ms']:.1f} ms", None)

    summary = rerank_summary(rows_of("rerank"))
    ratio = summary.get("every_step", {}).get("rerank_cost_vs_stability_aware")
    add("rerank cost, every head every step / stability-aware (paper: 2.44x)",
        None if ratio is None else f"{ratio:.2f}x", None)
    return out


# ------------------------------------------------------------------------------------------------------ sections


def memory_section(results: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    out = []
    for row in rows:
        dyn = find(rows, system="dynamic", context=row["context"], model=row["model"])
        full = row["full_depth"]
        share = None if not dyn else (row["device_kv_bytes"] + row["device_metadata_bytes"]) / dyn["device_kv_bytes"]
        out.append([row["model"], str(row["context"]), row["system"], size(full["device_bytes"]),
                    fmt(share, 1, 0.01, "%"), size(full["device_reserved_bytes"]), size(full["host_reserved_bytes"]),
                    size(full.get("peak_bytes")), fmt(row["prefill_ms"], 0)])
    layers = rows[0]["full_depth"]["layers"]
    return table(["model", "context", "system", f"device KV+meta ({layers} layers)", "% of Dynamic",
                  "device reserved", "host reserved", "peak (est.)", f"prefill ms ({rows[0]['layers']} layers)"], out)


def decode_section(results: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    parts = []
    loops = results.get("loop", [])
    if loops:
        parts.append("Loop calibration (DynamicCache; measured on 1 and L layers, full depth extrapolated):\n\n" + table(
            ["model", "batch", "context", "step ms, 1 layer", "step ms, L layers", "L", "per-layer ms", "fixed ms",
             "full-depth step ms"],
            [[loop["model"], str(loop["batch"]), str(loop["context"]), fmt(loop["step_ms_1_layer"]),
              fmt(loop["step_ms"]), str(loop["layers"]), fmt(loop["per_layer_ms"], 3), fmt(loop["fixed_ms"]),
              fmt(loop["full_depth_step_ms"], 1)] for loop in loops]))
    out = []
    for row in rows:
        dyn = find(rows, system="dynamic", context=row["context"], batch=row["batch"], model=row["model"])
        full = row.get("full_depth") or {}
        dyn_full = (dyn or {}).get("full_depth") or {}
        out.append([row["model"], str(row["context"]), str(row["batch"]), row["system"], fmt(row["step_ms_p50"]),
                    fmt(row["step_ms_p99"]), fmt(row["p99_over_p50"]), fmt(row["tokens_per_s"], 0),
                    fmt(row.get("device_busy_ms")), fmt(row.get("gpu_idle_share"), 0, 0.01, "%"),
                    fmt(row.get("warmup_max_ms"), 0),
                    fmt(dyn and dyn["step_ms_p50"] / row["step_ms_p50"]), fmt(full.get("step_ms_p50"), 1),
                    fmt(full.get("tokens_per_s"), 0),
                    fmt(full and dyn_full and dyn_full["step_ms_p50"] / full["step_ms_p50"]),
                    size(row.get("bytes_h2d_per_step"))])
    parts.append(table(["model", "context", "batch", "system", "p50 ms", "p99 ms", "p99/p50", "tok/s",
                        "GPU busy ms", "GPU idle", "warm-up max ms", "x Dynamic", "full-depth p50 ms (est.)",
                        "full-depth tok/s (est.)", "full-depth x Dynamic", "H2D/step"], out))
    return "\n\n".join(parts)


def attention_section(results: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    out = []
    for row in rows:
        for name in ("dense_flashinfer", "flexicache", "quest_like", "dynamic_sdpa"):
            system = row[name]
            out.append([str(row["context"]), str(row["batch"]), name, fmt(system["step_ms_p50"], 3),
                        fmt(system["layer_ms_p50"], 3), fmt(system["host_issue_ms_p50"] / row["layers"], 3),
                        fmt(system["step_ms_p99"], 3), fmt(row["speedup_vs_dense_flashinfer"].get(name, 1.0)),
                        fmt(system["device_kv_bytes"], 2, GIB)])
    return table(["context", "batch", "system", f"step ms ({rows[0]['layers']} layers)", "ms/layer",
                  "host issue ms/layer", "p99 ms", "x dense FlashInfer", "device KV GiB"], out)


def rerank_section(results: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    summary = rerank_summary(rows)
    out = [[name, fmt(item["step_ms_p50"], 3), fmt(item["host_issue_ms_p50"], 3), fmt(item["rerank_ms"], 3),
            fmt(item["reranked_rows_per_step"], 1), fmt(item["promoted_fraction"], 1, 0.01, "%"),
            size(item["h2d_bytes_per_stable_rerank_row"]), size(item["h2d_bytes_per_step"]),
            fmt(item.get("rerank_cost_vs_stability_aware")), fmt(item.get("step_time_vs_stability_aware"))]
           for name, item in summary.items()]
    first = rows[0]
    return (f"{first['layers']} attention layers, batch {first['batch']}, context {first['context']}, budget "
            f"{first['budget']}, query correlation {first['query_correlation']} (random keys: the promoted fraction "
            "is near its worst case; a real model's stable heads promote far fewer pages).\n\n" + table(
                ["schedule", "step ms p50", "host issue ms", "rerank ms", "reranked rows/step", "promoted",
                 "H2D/stable rerank row", "H2D/step", "rerank cost vs stability-aware",
                 "step time vs stability-aware"], out))


def throughput_section(results: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    out = []
    for row in rows:
        dyn = find(rows, system="dynamic", model=row["model"])
        tps, dyn_tps = full_or_measured(row, "tokens_per_s"), dyn and full_or_measured(dyn, "tokens_per_s")
        out.append([row["model"], row["system"], str(row["largest_batch"]), row["bound"],
                    fmt(dyn and dyn["largest_batch"] and row["largest_batch"] / dyn["largest_batch"]),
                    fmt(row.get("tokens_per_s"), 0), fmt((row.get("full_depth") or {}).get("tokens_per_s"), 0),
                    fmt(tps and dyn_tps and tps / dyn_tps), size(row["device_bytes_per_sequence_full"]),
                    size(row["host_bytes_per_sequence_full"])])
    return table(["model", "system", "largest batch (est.)", "bound", "x Dynamic", "tok/s (L layers)",
                  "tok/s full depth (est.)", "tok/s x Dynamic", "device/seq (full)", "host/seq (full)"], out)


def mix_section(results: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    out = []
    for row in rows:
        dyn = find(rows, system="dynamic", model=row["model"])
        full = row.get("full_depth") or {}
        dyn_full = (dyn or {}).get("full_depth") or {}
        out.append([row["model"], row["system"], str(row["requests"]), str(row["batch"]), fmt(row["prefill_s"]),
                    fmt(row["decode_s"]), f"{row['decode_steps_measured']}/{row['decode_steps']}",
                    fmt(row["requests_per_s"], 3), fmt(row["output_tokens_per_s"], 0),
                    fmt(full.get("requests_per_s"), 4),
                    fmt(dyn_full.get("requests_per_s") and full.get("requests_per_s", 0) / dyn_full["requests_per_s"])])
    return table(["model", "system", "requests", "batch", "prefill s", "decode s", "steps measured/total", "req/s",
                  "output tok/s", "full-depth req/s (est.)", "full-depth x Dynamic"], out)


SECTIONS = {"memory": ("Memory vs context (batch 1)", memory_section),
            "decode": ("Decode step latency and tokens/s", decode_section),
            "attention": ("Attention layer (dense FlashInfer baseline)", attention_section),
            "rerank": ("Rerank ablation", rerank_section),
            "throughput": ("Largest batch and tokens/s there", throughput_section),
            "mix": ("Offline mix (L-Eval-like lengths)", mix_section)}


def render_report(results: dict[str, Any], plot_prefix: str = "") -> str:
    """The report; plot links point to ``plot_prefix/<name>.png`` (beside the report by default)."""
    env, settings = results["env"], results["settings"]
    hardware = env.get("gpu") or f"CPU ({env['cpu_count']} cores)"
    lines = [
        f"### flexicache bench: {hardware}", "",
        f"Command: `{results['command']}`", "",
        (f"torch {env['torch']}, transformers {env['transformers']}, flashinfer {env['flashinfer'] or 'not installed'}"
         f", CUDA {env.get('cuda') or '-'}, host RAM {env['host_ram_bytes'] / GIB:.0f} GiB, Python {env['python']}."),
        (f"Models {', '.join(settings['models'])} (random weights, {settings['dtype']}), {settings['layers']} decoder "
         "layers run; `full depth` numbers are extrapolated per layer (estimates), all others measured. Warm-up (JIT "
         f"compile) {results.get('warmup_s', '-')} s, excluded from timings; run {results.get('elapsed_s', '-')} s."),
        "", "#### Targets", "",
        table(["target", "value", "status"], [[t["target"], t["value"], t["status"]] for t in targets(results)]),
    ]
    for case, (title, render) in SECTIONS.items():
        data = results.get("cases", {}).get(case)
        if data is None:
            continue
        rows = data["rows"]
        lines += ["", f"#### {title}", ""]
        lines += [f"{note}\n" for note in data["notes"]]
        if rows:
            lines.append(render(results, rows))
        if data["skipped"]:
            lines.append("")
        for skip in data["skipped"]:
            label = ", ".join(f"{key}={value}" for key, value in skip.items() if key != "reason")
            lines.append(f"- skipped ({label}): {skip['reason']}")
    plots = results.get("plots") or []
    if plots:
        lines += ["", "#### Plots", ""] + [f"![{name}]({plot_prefix + '/' if plot_prefix else ''}{name})"
                                            for name in plots]
    return "\n".join(lines) + "\n"
