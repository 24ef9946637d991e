"""Markdown report of a ``flexicache bench`` run (from its ``bench.json`` alone), targets included."""

from __future__ import annotations

import math
import shlex
from typing import Any

from flexicache.benchmarks.attention import ATTENTION_SYSTEMS
from flexicache.benchmarks.decode import calibration, extrapolate
from flexicache.benchmarks.memory import offload_full_depth, prefill_text
from flexicache.benchmarks.rerank import rerank_summary
from flexicache.benchmarks.suite import full_layers

GIB = 2**30
NA = "n/a (calibration inconsistent)"
STATUSES = ("met", "NOT met", "reported", "not measured", "pending")


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


# --------------------------------------------------------------------------------------------- full depth


def checked_loop(loop: dict[str, Any]) -> dict[str, Any]:
    """A loop calibration entry with its consistency (re)derived from the two measured step times, so that entries
    of older runs (which clamped the fixed cost instead) are judged like new ones."""
    full = loop.get("full_layers") or full_layers(loop["model"])
    return {**loop, "full_layers": full, **calibration(loop["step_ms_1_layer"], loop["step_ms"], loop["layers"], full)}


def loops(results: dict[str, Any]) -> list[dict[str, Any]]:
    return [checked_loop(loop) for loop in results.get("loop", [])]


def loop_for(results: dict[str, Any], model: str, batch: int) -> dict[str, Any] | None:
    return find(loops(results), model=model, batch=batch)


def step_full_depth(results: dict[str, Any], row: dict[str, Any], batch: int) -> tuple[dict[str, float] | None, str]:
    """``(full-depth step_ms_p50 and tokens_per_s, "")`` re-derived from the row's measured p50 and the loop
    calibration at ``batch``, else ``(None, why)``: "-" without a calibration, NA when it is inconsistent."""
    loop = loop_for(results, row["model"], batch)
    if loop is None or "step_ms_p50" not in row:
        return None, "-"
    if not loop["consistent"]:
        return None, NA
    step = extrapolate(loop, row["step_ms_p50"], row["layers"], loop["full_layers"])
    if step is None:
        return None, "n/a (step below the loop's fixed cost)"
    return {"step_ms_p50": step, "tokens_per_s": 1000 * batch / step}, ""


def mix_batches(results: dict[str, Any], row: dict[str, Any]) -> list[int]:
    """Batch sizes whose loop calibration a mix row's full-depth estimate used."""
    if "loop_batches" in row:
        return row["loop_batches"]
    settings = results["settings"]
    count, size_ = settings["mix_requests"], settings["mix_batch"]
    return sorted({min(size_, count - start) for start in range(0, count, size_)})


def mix_full_depth(results: dict[str, Any], row: dict[str, Any]) -> tuple[dict[str, float] | None, str]:
    entries = [loop_for(results, row["model"], batch) for batch in mix_batches(results, row)]
    if not entries or any(entry is None for entry in entries):
        return None, "-"
    if not all(entry["consistent"] for entry in entries):
        return None, NA
    full = row.get("full_depth")
    if not full or full.get("requests_per_s", -1) <= 0:
        return None, "-"
    return full, ""


def memory_full(row: dict[str, Any]) -> dict[str, Any]:
    """The memory row's full-depth bytes (``dynamic-offload``: one resident layer at any depth)."""
    if row["system"] == "dynamic-offload" and not row["full_depth"].get("offloading"):
        return offload_full_depth(row)
    return row["full_depth"]


def cell(value: float | None, why: str, digits: int = 1) -> str:
    return why if value is None else fmt(value, digits)


# ------------------------------------------------------------------------------------------------------- targets


def host_bound_facts(results: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """Numbers behind a throughput row's host bound: pinned bytes per sequence (what the bound uses), the host
    tier's reserved bytes per sequence at the largest batch, the stable heads' exact KV per sequence, full depth."""
    settings = results["settings"]
    scale = full_layers(row["model"]) / row["layers"]
    facts: dict[str, Any] = {"pinned": row["host_bytes_per_sequence_full"], "limit": row["host_limit_bytes"],
                             "stable_share": 1 - settings["unstable_fraction"]}
    if row.get("largest_batch") and row.get("host_reserved_bytes"):
        facts["reserved"] = row["host_reserved_bytes"] / row["largest_batch"] * scale
    memory = find(case_rows(results, "memory"), model=row["model"], system=row["system"],
                  context=row["context"], batch=1)
    if memory is not None:
        facts["kv"] = memory["host_kv_bytes"] * full_layers(row["model"]) / memory["layers"]
    elif row.get("probe_host_kv_bytes"):
        facts["kv"] = row["probe_host_kv_bytes"] / row["probe_batch"] * scale
    if facts.get("kv"):
        facts["batch_at_kv"] = math.floor(row["host_limit_bytes"] / facts["kv"])
    return facts


def targets(results: dict[str, Any]) -> list[dict[str, str]]:
    """Issue 6's targets for the run's first model at its long context, batch and budget (32k, 8, 1024 on the GPU):
    value and status. Step-time ratios are judged on full-depth estimates when the loop calibration is consistent,
    else on the measured (``--layers``) numbers, and the value says which."""
    settings = results["settings"]
    context, batch, budget = settings["attention_context"], settings["attention_batch"], settings["budget"]
    system, model = f"flexicache-{budget}", settings["models"][0]
    full = full_layers(model)
    out = []

    def rows_of(case: str) -> list[dict[str, Any]]:
        return [row for row in case_rows(results, case) if row.get("model") == model]

    def add(name: str, value: str | None, met: bool | None, status: str | None = None) -> None:
        if status is None:
            status = "pending" if value is None else ("reported" if met is None else ("met" if met else "NOT met"))
        out.append({"target": name, "value": value or "no data in this run", "status": status})

    memory = rows_of("memory")
    fc, dyn = find(memory, system=system, context=context), find(memory, system="dynamic", context=context)
    memory_fc, memory_dyn = fc, dyn  # for the peak target: ``fc``/``dyn`` name other rows further down
    if fc and dyn:
        share = (fc["device_kv_bytes"] + fc["device_metadata_bytes"]) / dyn["device_kv_bytes"]
        add(f"device KV <= 30% of DynamicCache at {context} tokens, budget {budget}",
            f"{share:.1%} with page min/max ({fc['device_kv_bytes'] / dyn['device_kv_bytes']:.1%} pages only, "
            f"{fc['device_reserved_bytes'] / dyn['device_kv_bytes']:.1%} reserved); batch {fc.get('batch', 1)}, after "
            f"{settings['memory_steps']} decode steps", share <= 0.30)
    else:
        add(f"device KV <= 30% of DynamicCache at {context} tokens, budget {budget}", None, None)

    layer = rows_of("attention")
    # With whole-step graphs (what generate runs) when the run has them, else the layer-by-layer system.
    layered = "flexicache_step_graph" if layer and "flexicache_step_graph" in layer[0] else "flexicache"
    speedup = layer[0]["speedup_vs_dense_flashinfer"][layered] if layer else None
    add(f"attention-layer speedup >= 4x vs dense FlashInfer at {context}, batch {batch}",
        None if speedup is None else (f"{speedup:.2f}x ({layered}: {layer[0][layered]['layer_ms_p50']:.3f} vs "
                                      f"{layer[0]['dense_flashinfer']['layer_ms_p50']:.3f} ms/layer, p50)"),
        None if speedup is None else speedup >= 4)

    decode = rows_of("decode")
    name = f"generate step at {context}, batch {batch} <= 1.2x the same loop at {settings['loop_context']}"
    long_row = find(decode, system=system, context=context, batch=batch)
    short_row = find(decode, system=system, context=settings["loop_context"], batch=batch)
    if long_row and short_row:
        ratio = long_row["step_ms_p50"] / short_row["step_ms_p50"]
        value = (f"{ratio:.2f}x measured on {long_row['layers']} layers ({long_row['step_ms_p50']:.1f} vs "
                 f"{short_row['step_ms_p50']:.1f} ms, p50)")
        long_full, why = step_full_depth(results, long_row, batch)
        short_full, _ = step_full_depth(results, short_row, batch)
        if long_full and short_full:
            ratio = long_full["step_ms_p50"] / short_full["step_ms_p50"]
            value += f"; {ratio:.2f}x full-depth estimate"
        else:
            k = full / long_row["layers"]
            bound = max(ratio, k * ratio - (k - 1))  # fixed cost f in [0, shorter step]: worst case at an end
            value += (f"; full-depth estimate {why if why != '-' else 'not measured'}; if step = fixed + layers x "
                      f"per-layer cost with any fixed cost in [0, "
                      f"{min(long_row['step_ms_p50'], short_row['step_ms_p50']):.1f}] ms, the {full}-layer ratio is "
                      f"at most {bound:.2f}x")
        add(name, value, ratio <= 1.2)
    else:
        add(name, None, None)

    throughput = rows_of("throughput")
    fc, dyn = find(throughput, system=system), find(throughput, system="dynamic")
    name_batch = f"largest batch at {settings['throughput_context']} >= 1.5x DynamicCache's"
    name_tps = "tokens/s at the largest batch >= 2x DynamicCache's at its largest"
    if fc and dyn and dyn.get("largest_batch"):
        ratio = fc["largest_batch"] / dyn["largest_batch"]
        value = (f"{fc['largest_batch']} vs {dyn['largest_batch']} = {ratio:.2f}x (estimated for {full} layers; "
                 f"bound: {fc['bound']})")
        if fc["bound"] == "host":
            facts = host_bound_facts(results, fc)
            value += (f": {fc['largest_batch']} = floor({size(facts['limit'])} host limit / {size(facts['pinned'])} "
                      f"of pinned host memory per sequence), because the host tier keeps the full KV of the stable "
                      f"heads ({facts['stable_share']:.0%} of the KV heads)")
            if facts.get("batch_at_kv"):
                value += (f"; even at their bare KV ({size(facts['kv'])} per sequence) the host would hold "
                          f"{facts['batch_at_kv']} < the {math.ceil(1.5 * dyn['largest_batch'])} needed")
        add(name_batch, value, ratio >= 1.5)
        fc_full, why = step_full_depth(results, fc, fc["largest_batch"])
        dyn_full, _ = step_full_depth(results, dyn, dyn["largest_batch"])
        if fc.get("tokens_per_s") and dyn.get("tokens_per_s"):
            tps_ratio = fc["tokens_per_s"] / dyn["tokens_per_s"]
            value = (f"{fc['tokens_per_s']:.0f} (batch {fc['largest_batch']}) vs {dyn['tokens_per_s']:.0f} "
                     f"(batch {dyn['largest_batch']}) tok/s = {tps_ratio:.2f}x measured on {fc['layers']} layers")
            if fc_full and dyn_full:
                tps_ratio = fc_full["tokens_per_s"] / dyn_full["tokens_per_s"]
                value += (f"; {fc_full['tokens_per_s']:.0f} vs {dyn_full['tokens_per_s']:.0f} tok/s = "
                          f"{tps_ratio:.2f}x full-depth estimate")
            else:
                value += f"; full-depth estimate {why if why != '-' else 'not measured'}"
            add(name_tps, value, tps_ratio >= 2)
        else:
            add(name_tps, None, None)
    else:
        add(name_batch, None, None)
        add(name_tps, None, None)

    add(f"p99/p50 step time <= 1.3 ({system}, {context}, batch {batch})",
        None if long_row is None else (f"{long_row['p99_over_p50']:.2f} (p50 {long_row['step_ms_p50']:.1f} ms, "
                                       f"p99 {long_row['step_ms_p99']:.1f} ms = slowest of {settings['steps']} "
                                       f"steps, {long_row['layers']} layers)" if settings["steps"] < 100 else
                                       f"{long_row['p99_over_p50']:.2f} (p99 {long_row['step_ms_p99']:.1f} ms)"),
        None if long_row is None else long_row["p99_over_p50"] <= 1.3)

    name = f"fixed cost of the transformers loop (DynamicCache, {settings['loop_context']} tokens, batch {batch})"
    loop = loop_for(results, model, batch)
    if loop is None:
        add(name, None, None)
    elif loop["consistent"]:
        add(name, f"{loop['step_ms']:.1f} ms/step on {loop['layers']} layers = {loop['fixed_ms']:.1f} ms fixed + "
            f"{loop['per_layer_ms']:.2f} ms/layer; full depth {loop['full_depth_step_ms']:.1f} ms (estimate)", None)
    else:
        add(name, f"not measured: calibration inconsistent, {loop['inconsistency']}", None, "not measured")

    name = "rerank time, every head every step / stability-aware (paper: 2.44x)"
    summary = rerank_summary(rows_of("rerank"))
    every, aware = summary.get("every_step"), summary.get("stability_aware")
    if every is None or aware is None:
        add(name, None, None)
    elif every.get("rerank_time_vs_stability_aware") is not None:
        add(name, f"{every['rerank_time_vs_stability_aware']:.2f}x ({every['rerank_ms']:.3f} vs "
            f"{aware['rerank_ms']:.3f} ms/step: mean step over no_rerank's, one run); reranked rows/step "
            f"{every['rows_vs_stability_aware']:.2f}x", None)
    else:
        why = ("this run recorded no mean step times" if aware["rerank_ms"] is None else
               f"stability-aware rerank time {aware['rerank_ms']:.3f} ms <= 0: within noise")
        add(name, f"not measured ({why}); the reranked rows per step ratio is "
            f"{every['reranked_rows_per_step']:.0f} / {aware['reranked_rows_per_step']:.0f} = "
            f"{every['rows_vs_stability_aware']:.2f}x (rows, not time)", None, "not measured")

    name = f"peak device memory, prefill + decode, at {context} tokens <= 50% of DynamicCache's"
    measured = bool(memory_fc and memory_dyn)
    fc_peak, dyn_peak = (None if row is None else row["full_depth"].get("peak_bytes") for row in (memory_fc, memory_dyn))
    if fc_peak is None or dyn_peak is None:
        add(name, "not measured: the CUDA allocator's peak (a GPU run of the memory case)" if measured else None,
            None, "not measured" if measured else None)
    else:
        how = "measured" if memory_fc["layers"] == memory_fc["full_depth"]["layers"] else "estimated from fewer layers"
        add(name, f"{fc_peak / dyn_peak:.1%} ({size(fc_peak)} vs {size(dyn_peak)} at {full} layers, {how}; batch "
            f"{memory_fc.get('batch', 1)}, prefill in {prefill_text(memory_fc.get('prefill_chunk', 0))})",
            fc_peak / dyn_peak <= 0.5)
    return out


# ------------------------------------------------------------------------------------------------------ sections


def memory_section(results: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    out = []
    for row in rows:
        dyn = find(rows, system="dynamic", context=row["context"], model=row["model"])
        full = memory_full(row)
        share = None if not dyn else full["device_bytes"] / memory_full(dyn)["device_kv_bytes"]
        device = size(full["device_bytes"])
        if full.get("offloading"):
            device += f" ({full['device_resident_layers']} layer resident)"
        out.append([row["model"], str(row["context"]), row["system"], device,
                    fmt(share, 1, 0.01, "%"), size(full["device_reserved_bytes"]), size(full["host_reserved_bytes"]),
                    size(full.get("peak_bytes")), fmt(row["prefill_ms"], 0)])
    layers = rows[0]["full_depth"]["layers"]
    text = table(["model", "context", "system", f"device KV+meta ({layers} layers)", f"% of Dynamic ({layers} layers)",
                  f"device reserved ({layers} layers)", f"host reserved ({layers} layers)",
                  f"peak ({layers} layers, est.)", f"prefill ms ({rows[0]['layers']} layers)"], out)
    offload = [row for row in rows if row["system"] == "dynamic-offload"]
    if offload:
        row = offload[0]
        full = memory_full(row)
        text += (f"\n\n`dynamic-offload` (`DynamicCache(offloading=True)`) keeps one prefetched layer on the "
                 f"device whatever the depth (transformers' offloading; measured: {full['device_resident_layers']} of "
                 f"{row['layers']} layers, {row['device_fraction_of_dense']:.1%} of the {row['layers']}-layer KV), so "
                 f"its device bytes are not scaled to {layers} layers and its host bytes are the other layers' KV; "
                 "its peak does not grow with depth. `% of Dynamic` = device KV+meta / DynamicCache's device KV at "
                 f"the same context, both at {layers} layers.")
    return text


def loop_table(results: dict[str, Any]) -> str:
    rows = []
    for loop in loops(results):
        runs = f"median of {loop['rounds']} runs" if loop.get("rounds") else "1 run each, 1 layer first"
        rows.append([loop["model"], str(loop["batch"]), str(loop["context"]), fmt(loop["step_ms_1_layer"]),
                     fmt(loop["step_ms"]), str(loop["layers"]),
                     "n/a" if loop["per_layer_ms"] is None else fmt(loop["per_layer_ms"], 3),
                     "n/a" if loop["fixed_ms"] is None else fmt(loop["fixed_ms"]),
                     "n/a" if loop["full_depth_step_ms"] is None else fmt(loop["full_depth_step_ms"], 1), runs,
                     "consistent" if loop["consistent"] else f"INCONSISTENT: {loop['inconsistency']}"])
    text = ("Loop calibration (DynamicCache; measured on 1 and L layers, p50 step ms; full depth extrapolated):\n\n"
            + table(["model", "batch", "context", "step ms, 1 layer", "step ms, L layers", "L", "per-layer ms",
                     "fixed ms", "full-depth step ms", "runs", "calibration"], rows))
    bad = [loop for loop in loops(results) if not loop["consistent"]]
    if bad:
        text += (f"\n\n{len(bad)} of {len(rows)} calibrations are inconsistent (a 1-layer model does strictly less "
                 "work per step than an L-layer one, so a slower 1-layer step is a measurement artefact); every "
                 f"full-depth estimate that would use them is reported as {NA}.")
    return text


def decode_section(results: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    parts = []
    if results.get("loop"):
        parts.append(loop_table(results))
    estimates = {id(row): step_full_depth(results, row, row["batch"]) for row in rows}
    with_full = any(full for full, _ in estimates.values())
    out = []
    for row in rows:
        dyn = find(rows, system="dynamic", context=row["context"], batch=row["batch"], model=row["model"])
        rounds = " / ".join(fmt(ms) for ms in row.get("round_p50_ms", [])) or "-"  # runs before rounds: "-"
        line = [row["model"], str(row["context"]), str(row["batch"]), row["system"], fmt(row["step_ms_p50"]),
                rounds, fmt(row["step_ms_p99"]), fmt(row["p99_over_p50"]), fmt(row["tokens_per_s"], 0),
                fmt(row.get("device_busy_ms")), fmt(row.get("gpu_idle_share"), 0, 0.01, "%"),
                fmt(row.get("warmup_max_ms"), 0), fmt(dyn and dyn["step_ms_p50"] / row["step_ms_p50"]),
                size(row.get("bytes_h2d_per_step"))]
        if with_full:
            full, why = estimates[id(row)]
            dyn_full = dyn and estimates[id(dyn)][0]
            line += [cell(full and full["step_ms_p50"], why), cell(full and full["tokens_per_s"], why, 0),
                     cell(full and dyn_full and dyn_full["step_ms_p50"] / full["step_ms_p50"], why if not full
                          else "-", 2)]
        out.append(line)
    layers = rows[0]["layers"]
    header = ["model", "context", "batch", "system", f"p50 ms ({layers} layers)", "p50 per round", "p99 ms",
              "p99/p50", "tok/s", "GPU busy ms", "GPU idle", "warm-up max ms", "x Dynamic (p50)", "H2D/step"]
    if with_full:
        header += ["full-depth p50 ms (est.)", "full-depth tok/s (est.)", "full-depth x Dynamic (est.)"]
    text = table(header, out)
    notes = " ".join(results["cases"]["decode"]["notes"])
    steps = results["settings"]["steps"]
    if "nearest rank" not in notes:
        text += (f"\n\np99 is the nearest rank over {steps} steps" + (": the slowest step" if steps < 100 else "")
                 + ", so p99/p50 is slowest/median.")
    text += ("\n\n`GPU busy ms`: kernels + copies per step (torch profiler, measured at batch "
             f"{results['settings']['attention_batch']} only); `GPU idle` = 1 - busy / p50. `H2D/step`: FlexiCache's "
             "host-to-device counter; `-` = not counted (DynamicCache).")
    if not with_full:
        text += (f"\n\nFull-depth ({full_layers(rows[0]['model'])}-layer) step times and tokens/s: "
                 + (NA if any(why == NA for _, why in estimates.values()) else "not measured")
                 + "; only the measured numbers above are reported.")
    parts.append(text)
    return "\n\n".join(parts)


def p99_rule(item: dict[str, Any], steps: int) -> str:
    if item.get("p99_rule") == "nearest-rank":
        return f"nearest rank of {steps} steps" + (" (the slowest)" if steps < 100 else "")
    rank = int(0.99 * (steps - 1)) + 1  # the rule of runs before nearest rank was recorded
    suffix = "th" if 10 <= rank % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(rank % 10, "th")
    return f"the {rank}{suffix} of {steps} sorted steps" + (" (the second slowest)" if rank == steps - 1 else "")


def attention_section(results: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    out = []
    for row in rows:
        for name in ATTENTION_SYSTEMS:
            if name not in row:  # runs before the step-graph system existed
                continue
            system = row[name]
            out.append([str(row["context"]), str(row["batch"]), name, fmt(system["step_ms_p50"], 3),
                        fmt(system["layer_ms_p50"], 3), fmt(system["host_issue_ms_p50"] / row["layers"], 3),
                        fmt(system["step_ms_p99"], 3), fmt(row["speedup_vs_dense_flashinfer"].get(name, 1.0)),
                        size(system["device_kv_bytes"])])
    first = rows[0]
    layers = first["layers"]
    caption = (f"{layers} attention layers only (no model), batch {first['batch']}, context {first['context']}, budget "
               f"{first['budget']}, {first['unstable_fraction']:.0%} of each layer's KV heads unstable; random "
               f"keys/values and {first.get('queries', 8)} random queries, cycled. Step times from CUDA events: "
               f"median of {first['steps']} steps after {first.get('warmup', results['settings']['warmup'])} warm-up "
               f"steps; p99 = {p99_rule(first['flexicache'], first['steps'])}. Device KV+meta: FlexiCache's after "
               "the prefill, DynamicCache's after the timed steps.\n\n")
    return caption + table(["context", "batch", "system", f"step ms p50 ({layers} layers)", "ms/layer p50",
                            "host issue ms/layer p50", f"step ms p99 ({layers} layers)", "x dense FlashInfer (p50)",
                            f"device KV+meta ({layers} layers)"], out)


def rerank_section(results: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    summary = rerank_summary(rows)
    not_measured = "not measured"
    out = []
    for name, item in summary.items():
        has_mean = item["step_ms_mean"] is not None
        out.append([name, fmt(item["step_ms_p50"], 3), fmt(item["step_ms_mean"], 3) if has_mean else not_measured,
                    fmt(item["host_issue_ms_p50"], 3), fmt(item["p50_excess_ms"], 3),
                    (fmt(item["rerank_ms"], 3) if has_mean else not_measured) if name != "quest_like"
                    else "n/a (no host tier)",
                    fmt(item["reranked_rows_per_step"], 1), fmt(item["promoted_fraction"], 1, 0.01, "%"),
                    size(item["h2d_bytes_per_stable_rerank_row"]), size(item["h2d_bytes_per_step"]),
                    ("-" if "rows_vs_stability_aware" not in item else
                     fmt(item["rerank_time_vs_stability_aware"]) if item["rerank_time_vs_stability_aware"]
                     is not None else (not_measured if name != "quest_like" else "n/a")),
                    fmt(item.get("rows_vs_stability_aware"))])
    first = rows[0]
    steps = first["window"]["decode_steps"]
    interval = find(rows, schedule="stability_aware") or {}
    interval = interval.get("rerank_interval")
    text = (f"{first['layers']} attention layers, batch {first['batch']}, context {first['context']}, budget "
            f"{first['budget']}, query correlation {first['query_correlation']} (random keys: the promoted fraction "
            f"is near its worst case; a real model's stable heads promote far fewer pages); {steps} timed steps "
            f"after {results['settings']['warmup']} warm-up steps, all schedules in one run. Rerank time = mean "
            "step time minus `no_rerank`'s mean (reranks amortised over the steps: scoring, selection, "
            "promotions).\n\n" + table(
                ["schedule", "step ms p50", "step ms mean", "host issue ms p50", "p50 - no_rerank p50 ms",
                 "rerank ms/step (mean - no_rerank mean)", "reranked rows/step", "promoted",
                 "H2D/stable rerank row", "H2D/step", "rerank time x stability-aware",
                 "reranked rows x stability-aware"], out))
    aware, every = summary.get("stability_aware"), summary.get("every_step")
    if aware and every and aware["step_ms_mean"] is None:
        text += ("\n\nThis run recorded p50/p99 step times only (no mean), so the amortised rerank time and its ratio, "
                 "the paper's 2.44x metric, are not measured. ")
        if aware["p50_excess_ms"]:
            text += (f"The ratio of the p50 excesses over `no_rerank`, {every['p50_excess_ms']:.3f} / "
                     f"{aware['p50_excess_ms']:.3f} ms = {every['p50_excess_ms'] / aware['p50_excess_ms']:.2f}x, "
                     "is not a rerank-time ratio")
            if interval and first["layers"] <= interval:
                holding = first["layers"] * steps // interval
                text += (f": the stability-aware schedule reranks each layer's stable heads every {interval} steps, "
                         f"staggered by layer, so {steps - holding} of its {steps} timed steps hold no stable rerank "
                         "and its median step does not reflect them")
            text += ". "
        text += (f"Reranked rows per step: {every['reranked_rows_per_step']:.0f} vs "
                 f"{aware['reranked_rows_per_step']:.0f} = {every['rows_vs_stability_aware']:.2f}x (a count, not a "
                 "time).")
    if "quest_like" in summary:
        text += ("\n\n`quest_like` keeps every page on the device and has no host tier, so its steps skip work the "
                 "`no_rerank` floor does; it gets no rerank time over that floor, only its step time.")
    return text


def throughput_section(results: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    estimates = {id(row): step_full_depth(results, row, row["largest_batch"]) if row.get("largest_batch") else
                 (None, "-") for row in rows}
    with_full = any(full for full, _ in estimates.values())
    out = []
    for row in rows:
        dyn = find(rows, system="dynamic", model=row["model"])
        line = [row["model"], row["system"], str(row["largest_batch"]), row["bound"],
                fmt(dyn and dyn["largest_batch"] and row["largest_batch"] / dyn["largest_batch"]),
                size(row["device_bytes_per_sequence_full"]), size(row["host_bytes_per_sequence_full"]),
                fmt(row.get("step_ms_p50")), fmt(row.get("tokens_per_s"), 0),
                fmt(row.get("tokens_per_s") and dyn and dyn.get("tokens_per_s")
                    and row["tokens_per_s"] / dyn["tokens_per_s"])]
        if with_full:
            full, why = estimates[id(row)]
            dyn_full = dyn and estimates[id(dyn)][0]
            line += [cell(full and full["tokens_per_s"], why, 0),
                     cell(full and dyn_full and full["tokens_per_s"] / dyn_full["tokens_per_s"], why if not full
                          else "-", 2)]
        out.append(line)
    layers = next((row["layers"] for row in rows if "layers" in row), results["settings"]["layers"])
    full_n = full_layers(rows[0]["model"])
    header = ["model", "system", f"largest batch ({full_n} layers, est.)", "bound", "x Dynamic",
              "device/seq (full, with decode transient)", "host/seq (full, pinned)", f"step ms p50 ({layers} layers)",
              f"tok/s ({layers} layers)",
              f"tok/s x Dynamic ({layers} layers)"]
    if with_full:
        header += ["tok/s full depth (est.)", "tok/s x Dynamic full depth (est.)"]
    text = table(header, out)
    for row in rows:
        if row["bound"] != "host":
            continue
        facts = host_bound_facts(results, row)
        dyn = find(rows, system="dynamic", model=row["model"])
        text += (f"\n\n`{row['system']}` is host-bound: {row['largest_batch']} = floor({size(facts['limit'])} host "
                 f"limit / {size(facts['pinned'])} per sequence). The host tier keeps the full KV of the stable heads "
                 f"({facts['stable_share']:.0%} of the KV heads) in pinned host memory: ")
        if facts.get("kv"):
            text += f"{size(facts['kv'])} of K+V per {row['context']}-token sequence at {full_n} layers (memory case), "
        if facts.get("reserved"):
            text += (f"{size(facts['reserved'])} reserved with the tier's growth room (at batch "
                     f"{row['largest_batch']}), ")
        text += (f"and {size(facts['pinned'])} of pinned blocks at the probe (batch {row['probe_batch']}; torch's "
                 "pinned allocator rounds blocks up), which the bound uses. The device alone would allow "
                 f"{row['batch_by_device']}.")
        if facts.get("batch_at_kv") and dyn and dyn.get("largest_batch"):
            need = math.ceil(1.5 * dyn["largest_batch"])
            text += (f" Even at the bare KV the host holds {facts['batch_at_kv']} sequences, short of the {need} "
                     f"that 1.5x DynamicCache's {dyn['largest_batch']} needs ({need} x {size(facts['kv'])} = "
                     f"{size(need * facts['kv'])} > {size(facts['limit'])}).")
    if not with_full:
        text += (f"\n\nFull-depth ({full_n}-layer) tokens/s: "
                 + (NA if any(why == NA for _, why in estimates.values()) else "not measured")
                 + f"; tokens/s above are measured on {layers} layers at the full-depth largest batch.")
    return text


def mix_section(results: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    estimates = {id(row): mix_full_depth(results, row) for row in rows}
    with_full = any(full for full, _ in estimates.values())
    out = []
    for row in rows:
        dyn = find(rows, system="dynamic", model=row["model"])
        line = [row["model"], row["system"], str(row["requests"]), str(row["batch"]), fmt(row["prefill_s"]),
                fmt(row["decode_s"]), f"{row['decode_steps_measured']}/{row['decode_steps']}",
                fmt(row["requests_per_s"], 3), fmt(row["output_tokens_per_s"], 0),
                fmt(dyn and row["requests_per_s"] / dyn["requests_per_s"])]
        if with_full:
            full, why = estimates[id(row)]
            dyn_full = dyn and estimates[id(dyn)][0]
            line += [cell(full and full["requests_per_s"], why, 4),
                     cell(full and dyn_full and full["requests_per_s"] / dyn_full["requests_per_s"],
                          why if not full else "-", 2)]
        out.append(line)
    layers = rows[0]["layers"]
    partial_ = any(row["decode_steps_measured"] < row["decode_steps"] for row in rows)
    est = " (est.)" if partial_ else ""
    header = ["model", "system", "requests", "batch", f"prefill s ({layers} layers)", f"decode s{est}",
              "steps measured/total", f"req/s{est}", f"output tok/s{est}", "req/s x Dynamic"]
    if with_full:
        header += ["full-depth req/s (est.)", "full-depth x Dynamic"]
    text = table(header, out)
    if partial_:
        text += ("\n\nDecode time, req/s and tok/s are estimates: the steps not measured count at the batch's "
                 f"median measured step ({layers} layers).")
    if not with_full:
        text += (f"\n\nFull-depth ({full_layers(rows[0]['model'])}-layer) req/s: "
                 + (NA if any(why == NA for _, why in estimates.values()) else "not measured") + ".")
    return text


SECTIONS = {"memory": ("Memory vs context", memory_section),
            "decode": ("Decode step latency and tokens/s", decode_section),
            "attention": ("Attention layer (dense FlashInfer baseline)", attention_section),
            "rerank": ("Rerank ablation", rerank_section),
            "throughput": ("Largest batch and tokens/s there", throughput_section),
            "mix": ("Offline mix (L-Eval-like lengths)", mix_section)}

PLOT_CAPTIONS = {"memory.png": "device bytes vs context, full depth (dynamic-offload: one resident layer)",
                 "decode_speedup.png": "DynamicCache p50 step / system p50 step, measured",
                 "rerank.png": "step time per rerank schedule, measured"}


def render_report(results: dict[str, Any], plot_prefix: str = "", rendered_by: str | None = None) -> str:
    """The report; plot links point to ``plot_prefix/<name>.png`` (beside the report by default). ``rendered_by``:
    the command that re-rendered it from ``bench.json`` (``--report-from``), stated under the measuring command."""
    env, settings = results["env"], results["settings"]
    hardware = env.get("gpu") or f"CPU ({env['cpu_count']} cores)"
    if env.get("gpu") and env.get("gpu_count"):
        hardware = f"{env['gpu_count']}x {hardware}"
    lines = [f"### flexicache bench: {hardware}", "", f"Measured by: `{results['command']}`", ""]
    if rendered_by:
        lines += [f"Report (every derived number, table and plot) rendered from its `bench.json` by: `{rendered_by}`",
                  ""]
    lines += [
        (f"torch {env['torch']}, transformers {env['transformers']}, flashinfer {env['flashinfer'] or 'not installed'}"
         f", CUDA {env.get('cuda') or '-'}, host RAM {env['host_ram_bytes'] / GIB:.0f} GiB, Python {env['python']}."),
        (f"Models {', '.join(settings['models'])} (random weights, {settings['dtype']}), {settings['layers']} decoder "
         "layers run; `full depth` numbers are extrapolated per layer (estimates, labelled so), all others measured. "
         f"Warm-up (JIT compile) {results.get('warmup_s', '-')} s, excluded from timings; run "
         f"{results.get('elapsed_s', '-')} s."),
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
        lines += ["", "#### Plots", ""]
        for name in plots:
            caption = PLOT_CAPTIONS.get(name)
            lines += [f"![{name}]({plot_prefix + '/' if plot_prefix else ''}{name})"] + (
                [f"{name}: {caption}", ""] if caption else [""])
    return "\n".join(lines).rstrip("\n") + "\n"


def rerender_command(report_from: str, out: str, update_benchmarks: str | None = None) -> str:
    """The ``--report-from`` command line, as stated in a re-rendered report."""
    args = ["python", "-m", "flexicache.cli", "bench", "--report-from", report_from, "--out", out]
    if update_benchmarks:
        args += ["--update-benchmarks", update_benchmarks]
    return shlex.join(args)
