"""``flexicache bench``: memory, decode latency, rerank ablation, throughput and an offline mix, side by side.

``--device cuda`` runs the GPU suite (Llama-3.1-8B shape with random weights, bf16, FlashInfer; ``--time-budget``
skips what does not fit); ``--device cpu`` runs the same cases on a tiny random model with the torch reference
backend (what CI runs). Every option left out takes the device's preset. Writes ``bench.json``, ``report.md`` and
PNG plots into ``--out``; ``--update-benchmarks BENCHMARKS.md`` then rewrites that file's generated sections
(:mod:`flexicache.benchmarks.document`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from flexicache.setting_specs import parse_boolean

# Settings field -> (type, nargs, help). Defaults come from suite.PRESETS[device].
OPTIONS: dict[str, tuple[type, str | None, str]] = {
    "models": (str, "+", "model shapes: llama-3.1-8b, mistral-7b, tiny-llama"),
    "layers": (int, None, "decoder layers actually run (full-depth numbers are extrapolated per layer)"),
    "dtype": (str, None, "float32, bfloat16 or float16"),
    "backend": (str, None, "FlexiCache decode backend: auto, reference, flashinfer"),
    "cuda_graphs": (str, None, ("FlexiCache CUDA graphs: step (whole decode steps replayed), layer (each layer's "
                                "decode replayed, the model's host work eager), off")),
    "cases": (str, "+", ("cases to run (always in this order): memory decode attention rerank throughput mix; "
                        "attention (dense FlashInfer baseline, CUDA) is not in the presets")),
    "time_budget": (float, None, "seconds for the whole run (0: unlimited); measurements past it are skipped"),
    "warmup": (int, None, "untimed decode steps before each timed window (>= 17 covers the host tier's growth)"),
    "steps": (int, None, "timed decode steps per measurement"),
    "profile_steps": (int, None, ("CUDA: extra decode steps under the torch profiler for the GPU busy time, in "
                               "the decode case at --attention-batch and the throughput case at each largest batch "
                               "(0: off)")),
    "unstable_fraction": (float, None, "share of each layer's KV heads that are unstable (random choice)"),
    "rerank_interval": (int, None, "stable heads' rerank interval"),
    "page_size": (int, None, "tokens per page"),
    "standby_pages": (str, None, ("pages a stable head keeps beyond those it attends to: a number, 'auto' (K) or "
                                  "'quarter' (K // 4)")),
    "exact_rescore": (parse_boolean, None, ("true: the attended pages chosen by their keys' attention mass among "
                                            "the box scores' candidates; false: by the box scores")),
    "exact_candidates": (int, None, "an unstable head's exact-rescoring candidates, in multiples of K"),
    "head_budgets": (str, None, "pages per head: uniform (K each) or prompt (split across a layer's heads)"),
    "seed": (int, None, "random seed"),
    "memory_contexts": (int, "+", "memory: context lengths"),
    "memory_systems": (str, "+", "memory: systems (dynamic, dynamic-offload, dense, flexicache-B, quest-B)"),
    "memory_steps": (int, None, "memory: decode steps after the prefill"),
    "memory_batch": (int, None, "memory: batch size"),
    "prefill_chunk": (int, None, ("memory: prefill the prompt in chunks of this many tokens (generate's "
                                  "prefill_chunk_size; 0: one forward)")),
    "decode_contexts": (int, "+", "decode: context lengths"),
    "decode_batches": (int, "+", "decode: batch sizes"),
    "decode_systems": (str, "+", "decode: systems"),
    "decode_rounds": (int, None, "decode: measurements per point, systems taking turns (step statistics pooled)"),
    "loop_context": (int, None, "context of the loop-cost calibration (DynamicCache, 1 and --layers layers)"),
    "offload_max_tokens": (int, None, "decode: skip dynamic-offload above batch x context tokens"),
    "attention_batch": (int, None, "attention-layer and rerank cases: batch (also the decode case's first point)"),
    "attention_context": (int, None, "attention-layer and rerank cases: context (also the decode case's first point)"),
    "budget": (int, None, "attention-layer and rerank cases: token budget"),
    "layer_steps": (int, None, "attention-layer and rerank cases: timed steps"),
    "query_correlation": (float, None, "rerank: correlation of consecutive random queries (0: independent)"),
    "throughput_context": (int, None, "throughput: context length"),
    "throughput_systems": (str, "+", "throughput: systems"),
    "probe_batch": (int, None, "throughput: batch of the memory probe"),
    "max_batch": (int, None, "throughput: cap on the largest batch"),
    "device_memory_gib": (float, None, "throughput: device memory (0: the GPU's)"),
    "host_memory_gib": (float, None, "throughput: host memory for the host tier (0: 85%% of RAM)"),
    "reserve_gib": (float, None, "throughput: device memory kept free (workspaces, fragmentation)"),
    "mix_requests": (int, None, "mix: number of requests"),
    "mix_batch": (int, None, "mix: static batch size"),
    "mix_input": (int, 2, "mix: input length range LOW HIGH"),
    "mix_output": (int, 2, "mix: output length range LOW HIGH"),
    "mix_max_steps": (int, None, "mix: decode steps measured per batch (the rest at the batch's median)"),
    "mix_systems": (str, "+", "mix: systems"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``flexicache bench``."""
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="cuda: the GPU suite; cpu: the tiny CPU suite; auto: cuda when available")
    parser.add_argument("--out", default="bench-results", help="output folder")
    parser.add_argument("--report-from", metavar="BENCH_JSON",
                        help="no measurement: re-render report.md and plots from a bench.json into --out")
    parser.add_argument("--update-benchmarks", metavar="MARKDOWN",
                        help=("then rewrite every generated section of this file (between '<!-- flexicache-bench "
                              "PATH/bench.json -->' and '<!-- /flexicache-bench -->') from the bench.json it names; "
                              "this run's bench.json must be one of them"))
    group = parser.add_argument_group("suite settings (default: the --device preset)")
    for name, (kind, nargs, help_text) in OPTIONS.items():
        flag = "--" + name.replace("_", "-")
        if nargs is None:
            group.add_argument(flag, type=kind, help=help_text)
        else:
            group.add_argument(flag, type=kind, nargs=nargs, help=help_text)


def settings_from(args: argparse.Namespace) -> Any:
    """The preset of ``--device`` overridden by the options given; raises ``SystemExit`` on a bad value."""
    import torch

    from flexicache.benchmarks.suite import CASES, MODEL_SHAPES, PRESETS, Settings, System, full_layers
    from flexicache.config import FlexiCacheConfig

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    values = dict(PRESETS[device], device=device)
    values.update({name: getattr(args, name) for name in OPTIONS if getattr(args, name, None) is not None})
    settings = Settings(**values)
    try:
        for model in settings.models:
            if model not in MODEL_SHAPES:
                raise ValueError(f"unknown model {model!r}: one of {sorted(MODEL_SHAPES)}")
            if not 1 <= settings.layers <= full_layers(model):
                raise ValueError(f"--layers must be between 1 and {full_layers(model)} for {model}")
        unknown = sorted(set(settings.cases) - set(CASES))
        if unknown:
            raise ValueError(f"unknown cases {unknown}: choose from {list(CASES)}")
        if settings.cuda_graphs not in ("step", "layer", "off"):
            raise ValueError(f"--cuda-graphs must be step, layer or off, got {settings.cuda_graphs!r}")
        names = {*settings.memory_systems, *settings.decode_systems, *settings.throughput_systems,
                 *settings.mix_systems}
        budgets = {settings.budget} | {System(name).budget for name in names} - {None}
        for budget in budgets:
            FlexiCacheConfig(token_budget=budget, page_size=settings.page_size)
        if min(settings.warmup, settings.steps, settings.layer_steps, settings.decode_rounds, settings.mix_max_steps,
               settings.probe_batch, settings.max_batch, settings.mix_requests, settings.mix_batch) < 1:
            raise ValueError("--warmup, --steps, --layer-steps, --decode-rounds, --mix-max-steps, --probe-batch, "
                             "--max-batch, --mix-requests and --mix-batch must be at least 1")
        if not 0.0 <= settings.unstable_fraction <= 1.0:
            raise ValueError(f"--unstable-fraction must be in [0, 1], got {settings.unstable_fraction}")
        if min(settings.time_budget, settings.device_memory_gib, settings.host_memory_gib, settings.reserve_gib) < 0:
            raise ValueError("--time-budget, --device-memory-gib, --host-memory-gib and --reserve-gib take 0 or "
                             "more (0: unlimited or the machine's own)")
        if settings.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be float32, bfloat16 or float16, got {settings.dtype!r}")
        for low, high in (settings.mix_input, settings.mix_output):
            if not 1 <= low <= high:
                raise ValueError("--mix-input and --mix-output take LOW HIGH with 1 <= LOW <= HIGH")
    except ValueError as error:
        raise SystemExit(f"flexicache bench: {error}") from error
    return settings


def run(args: argparse.Namespace) -> int:
    import torch

    from flexicache.benchmarks.document import check_named, update_document
    from flexicache.benchmarks.plots import write_plots
    from flexicache.benchmarks.report import render_report, rerender_command
    from flexicache.benchmarks.runner import run_suite

    out = Path(args.out)
    source = Path(args.report_from) if args.report_from else out / "bench.json"
    if args.update_benchmarks:
        check_named(Path(args.update_benchmarks), source)
    rendered_by = None
    if args.report_from:
        results = json.loads(Path(args.report_from).read_text(encoding="utf-8"))
        rendered_by = rerender_command(args.report_from, args.out, args.update_benchmarks)
        out.mkdir(parents=True, exist_ok=True)
        results["plots"] = write_plots(results, out)
        (out / "report.md").write_text(render_report(results, rendered_by=rendered_by), encoding="utf-8")
    else:
        settings = settings_from(args)
        if settings.device == "cpu":  # tiny tensors: intra-op threads only add hand-off latency
            torch.set_num_threads(1)
        results = run_suite(settings, out, "flexicache " + shlex.join(sys.argv[1:]))
        print(f"flexicache bench: wrote {out / 'bench.json'}")
    print(f"flexicache bench: wrote {out / 'report.md'} and plots {results.get('plots')}")
    if args.update_benchmarks:
        update_document(Path(args.update_benchmarks), source)
        print(f"flexicache bench: rewrote the generated sections of {args.update_benchmarks}")
    return 0

