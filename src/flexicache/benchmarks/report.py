"""Markdown report of a ``flexicache bench`` run, rendered from its ``bench.json`` alone: the setup, the headline
numbers, one section per case, the plots."""

from __future__ import annotations

import math
import shlex
from typing import Any

from flexicache.benchmarks.attention import ATTENTION_SYSTEMS
from flexicache.benchmarks.headlines import headlines
from flexicache.benchmarks.rerank import rerank_summary
from flexicache.benchmarks.results import (
    GIB,
    NA,
    batch_bound,
    cell,
    find,
    fmt,
    host_bound_facts,
    loops,
    memory_full,
    mix_full_depth,
    peak_of,
    size,
    step_full_depth,
    table,
)
from flexicache.benchmarks.suite import MODEL_SHAPES, full_layers

# ------------------------------------------------------------------------------------------------------ sections


def fewer_layers(rows: list[dict[str, Any]]) -> bool:
    """Whether the rows were measured on fewer layers than the model has (so full-depth estimates add something)."""
    return any(row.get("layers", 0) < full_layers(row["model"]) for row in rows)


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
                    size(peak_of(row)[0]), fmt(row["prefill_ms"], 0)])
    layers = rows[0]["full_depth"]["layers"]
    peak = f"peak ({layers} layers{', est.' if any(peak_of(row)[1] for row in rows) else ''})"
    text = table(["model", "context", "system", f"device KV+meta ({layers} layers)", f"% of Dynamic ({layers} layers)",
                  f"device reserved ({layers} layers)", f"host reserved ({layers} layers)",
                  peak, f"prefill ms ({rows[0]['layers']} layers)"], out)
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
    with_full = fewer_layers(rows) and any(full for full, _ in estimates.values())
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
    if layers < results["settings"]["rerank_interval"] and any(row["system"].startswith("flexicache") for row in rows):
        text += (f"\n\nWith {layers} layers, fewer than the rerank interval ({results['settings']['rerank_interval']}),"
                 " most steps hold no stable rerank (they are staggered over the layers): the p50 and the full-depth "
                 "estimates leave the reranks out.")
    if not with_full and fewer_layers(rows):
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
    with_full = fewer_layers(rows) and any(full for full, _ in estimates.values())
    out = []
    for row in rows:
        dyn = find(rows, system="dynamic", model=row["model"])
        line = [row["model"], row["system"], str(row["largest_batch"]), batch_bound(row),
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
    batch_header = (f"largest batch ({full_n} layers, est.)" if layers < full_n
                    else f"largest batch that ran ({full_n} layers)")
    header = ["model", "system", batch_header, "bound", "x Dynamic",
              "device/seq (full, with decode transient)", "host/seq (full, pinned)", f"step ms p50 ({layers} layers)",
              f"tok/s ({layers} layers)",
              f"tok/s x Dynamic ({layers} layers)"]
    if with_full:
        header += ["tok/s full depth (est.)", "tok/s x Dynamic full depth (est.)"]
    text = table(header, out)
    for row in rows:
        if row.get("out_of_memory_at"):
            text += (f"\n\n`{row['system']}` ran out of device memory at batch "
                     f"{', '.join(map(str, row['out_of_memory_at']))} (the estimate from the probe: "
                     f"{row['estimated_batch']}); " + (f"batch {row['largest_batch']} ran." if row.get("step_ms_p50")
                                                      else "no smaller batch tried ran."))
    for row in rows:
        if batch_bound(row) != "host":
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
        text += (f"and {size(facts['pinned'])} of pinned blocks at the probe (batch {row['probe_batch']}; the "
                 "pinned pool hands out whole blocks), which the bound uses. The device alone would allow "
                 f"{row['batch_by_device']}.")
        need = math.ceil(1.5 * dyn["largest_batch"]) if dyn and dyn.get("largest_batch") else None
        if facts.get("batch_at_kv") and need and facts["batch_at_kv"] < need:
            text += (f" Even at the bare KV the host holds {facts['batch_at_kv']} sequences, short of the {need} "
                     f"that 1.5x DynamicCache's {dyn['largest_batch']} needs ({need} x {size(facts['kv'])} = "
                     f"{size(need * facts['kv'])} > {size(facts['limit'])}).")
    if not with_full and layers < full_n:
        text += (f"\n\nFull-depth ({full_n}-layer) tokens/s: "
                 + (NA if any(why == NA for _, why in estimates.values()) else "not measured")
                 + f"; tokens/s above are measured on {layers} layers at the full-depth largest batch.")
    return text


def mix_section(results: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    estimates = {id(row): mix_full_depth(results, row) for row in rows}
    with_full = fewer_layers(rows) and any(full for full, _ in estimates.values())
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
    if not with_full and layers < full_layers(rows[0]["model"]):
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


PLOT_CASES = {"memory.png": "memory", "decode_speedup.png": "decode", "rerank.png": "rerank"}


def hardware(env: dict[str, Any]) -> str:
    """``"1x NVIDIA H200"``, or the CPU's core count."""
    if not env.get("gpu"):
        return f"CPU ({env['cpu_count']} cores)"
    return f"{env['gpu_count']}x {env['gpu']}" if env.get("gpu_count") else env["gpu"]


def model_text(name: str, settings: dict[str, Any]) -> str:
    """The model's shape, how many of its layers ran, weights and dtype."""
    shape = MODEL_SHAPES[name][1]
    full, layers = shape["num_hidden_layers"], settings["layers"]
    run = "all run" if layers == full else f"{layers} run, `full depth` numbers extrapolated per layer and labelled so"
    return (f"{name} shape: {full} decoder layers ({run}), hidden size {shape['hidden_size']}, "
            f"{shape['num_attention_heads']} query / {shape['num_key_value_heads']} KV heads, head dim "
            f"{shape['head_dim']}; random weights, {settings['dtype']}")


def setup_lines(results: dict[str, Any]) -> list[str]:
    """Hardware, software versions, models and cache settings of the run, one paragraph each."""
    env, settings = results["env"], results["settings"]
    software = [f"Python {env['python']}", f"torch {env['torch']}", f"transformers {env['transformers']}",
                f"FlashInfer {env['flashinfer'] or 'not installed'}"]
    software += [f"triton {env['triton']}"] if env.get("triton") else []
    software += [f"CUDA {env['cuda']}"] if env.get("cuda") else []
    software += [f"PYTORCH_CUDA_ALLOC_CONF={env['cuda_alloc_conf']}"] if env.get("cuda_alloc_conf") else []
    graphs = f"; CUDA graphs: {settings['cuda_graphs']}" if settings.get("cuda_graphs") else ""
    standby = settings.get("standby_pages", 0)  # runs that do not record it predate standby pages
    standby = {0: "no standby pages", "0": "no standby pages", "auto": "standby pages K",
               "quarter": "standby pages K // 4"}.get(
        standby, f"{standby} standby pages")
    # runs that do not record exact_rescore predate it: box scores
    selection = ("attended pages chosen by their keys' attention mass among the box scores' candidates (exact_rescore)"
                 if settings.get("exact_rescore", False) else "attended pages chosen by their box scores")
    if "exact_candidates" in settings:  # runs that do not record these ran with 2 K candidates and K per head
        selection += (f", {settings['exact_candidates']} x K candidates per unstable head, "
                      + ("pages split across each layer's KV heads at the prompt (head_budgets)"
                         if settings["head_budgets"] == "prompt" else "K pages per head"))
    return [f"{hardware(env)}, {env['cpu_count']} CPU cores, host RAM {env['host_ram_bytes'] / GIB:.0f} GiB; "
            f"{', '.join(software)}.",
            "Models: " + "; ".join(model_text(name, settings) for name in settings["models"]) + ".",
            (f"FlexiCache: {settings['unstable_fraction']:.0%} of each layer's KV heads unstable (chosen at random), "
             f"pages of {settings['page_size']} tokens, stable heads rerank every {settings['rerank_interval']} steps, "
             f"{standby}, {selection}, "
             f"backend {settings['backend']}{graphs}. Warm-up (JIT compile) {results.get('warmup_s', '-')} s, "
             f"excluded from timings; run {results.get('elapsed_s', '-')} s.")]


def render_body(results: dict[str, Any], plot_prefix: str = "", cases: list[str] | None = None, level: int = 4
                ) -> str:
    """Setup, headline numbers, the sections of ``cases`` (default: all the run has) with headings of ``level``,
    and their plots; plot links point to ``plot_prefix/<name>.png``."""
    heading = "#" * level
    lines = [line + "\n" for line in setup_lines(results)]
    found = headlines(results, cases)
    if found:
        lines += [f"{heading} Headline numbers", ""] + [f"- {line}" for line in found]
    for case, (title, render) in SECTIONS.items():
        data = results.get("cases", {}).get(case)
        if data is None or (cases is not None and case not in cases):
            continue
        rows = data["rows"]
        lines += ["", f"{heading} {title}", ""]
        lines += [f"{note}\n" for note in data["notes"]]
        if rows:
            lines.append(render(results, rows))
        if data["skipped"]:
            lines.append("")
        for skip in data["skipped"]:
            label = ", ".join(f"{key}={value}" for key, value in skip.items() if key != "reason")
            lines.append(f"- skipped ({label}): {skip['reason']}")
    plots = [name for name in results.get("plots") or [] if cases is None or PLOT_CASES.get(name) in cases]
    if plots:
        lines += ["", f"{heading} Plots", ""]
        for name in plots:
            caption = PLOT_CAPTIONS.get(name)
            lines += [f"![{name}]({plot_prefix + '/' if plot_prefix else ''}{name})"] + (
                [f"{name}: {caption}", ""] if caption else [""])
    return "\n".join(lines).rstrip("\n") + "\n"


def render_report(results: dict[str, Any], rendered_by: str | None = None) -> str:
    """The standalone report (``report.md``; its plots beside it). ``rendered_by``: the command that re-rendered it
    from ``bench.json`` (``--report-from``), stated under the measuring command."""
    lines = [f"### flexicache bench: {hardware(results['env'])}", "", f"Measured by: `{results['command']}`", ""]
    if rendered_by:
        lines += [f"Report (every derived number, table and plot) rendered from its `bench.json` by: `{rendered_by}`",
                  ""]
    return "\n".join(lines) + "\n" + render_body(results)


def rerender_command(report_from: str, out: str, update_benchmarks: str | None = None) -> str:
    """The ``--report-from`` command line, as stated in a re-rendered report."""
    args = ["python", "-m", "flexicache.cli", "bench", "--report-from", report_from, "--out", out]
    if update_benchmarks:
        args += ["--update-benchmarks", update_benchmarks]
    return shlex.join(args)
