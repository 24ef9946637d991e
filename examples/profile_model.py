"""Measure which KV heads of a model are temporally unstable and write a HeadProfile, through the profiler API.

This is what ``flexicache profile`` does, spelled out in a few calls: load calibration samples, decode them densely
while recording every head's top-K page set at every step, score each head's stability (random-corrected overlap
of its top-K sets ``d`` steps apart), classify the least stable heads as unstable, save the profile and plot it.

The defaults are small (a minute or two on a laptop CPU with SmolLM2-135M-Instruct, offline):

    python examples/profile_model.py --out smollm2_profile.json --plots plots/

A real profile uses longer prompts, more steps and more samples, e.g. the command the shipped SmolLM2 profile
records in its ``calibration["command"]``. Then use the profile:

    python examples/generate.py --profile smollm2_profile.json --prompt-file README.md --prompt "Summarise this."
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from flexicache.models import SMOLLM2, SMOLLM2_GGUF, load_model
from flexicache.profiling import ClassifySettings, MeasureSettings, build_profile, measure_samples
from flexicache.profiling.data import SYNTHETIC_TASKS, describe, load_samples
from flexicache.profiling.reports import format_reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=SMOLLM2, help="hub id, local folder, or 'smollm2' (offline, default)")
    parser.add_argument("--gguf-file", default=None, help="GGUF file name inside --model's folder")
    parser.add_argument("--data", nargs="+", default=["synthetic:passkey", "synthetic:docs"],
                        help=f"calibration data: synthetic:{{{','.join(SYNTHETIC_TASKS)}}}, LongBench .jsonl, "
                             "text files or folders")
    parser.add_argument("--samples-per-task", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="prompt length of each sample")
    parser.add_argument("--steps", type=int, default=48, help="decode steps traced per sample")
    parser.add_argument("--budget", type=int, default=128, help="token budget: K = budget / page size pages per head")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-distance", type=int, default=16, help="largest step distance d of the RCO")
    parser.add_argument("--fraction", type=float, default=0.25, help="share of all heads classified unstable")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    parser.add_argument("--out", default="profile.json", help="HeadProfile JSON to write")
    parser.add_argument("--plots", default=None, help="folder for the stability heatmap and RCO curve PNGs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    start = time.perf_counter()
    # The profiler records queries through its own probe attention; it loads the model with plain sdpa.
    model, tokenizer = load_model(args.model, gguf_file=args.gguf_file, device=args.device, dtype=torch.float32,
                                  attn_implementation="sdpa")
    print(f"loaded {args.model} on {model.device} in {time.perf_counter() - start:.1f} s")

    eos = tokenizer.eos_token_id
    settings = MeasureSettings(token_budget=args.budget, page_size=args.page_size, steps=args.steps,
                               max_distance=args.max_distance,
                               ban_token_ids=() if eos is None else (int(eos),))  # keep greedy answers decoding
    settings.validate()
    samples = [sample for spec in args.data for sample in load_samples(spec, args.samples_per_task, args.seed)]
    start = time.perf_counter()
    traces = measure_samples(model, tokenizer, samples, settings, args.prompt_tokens)
    print(f"traced {len(traces)} samples x {args.steps} steps in {time.perf_counter() - start:.1f} s")

    gguf_file = args.gguf_file or (SMOLLM2_GGUF if args.model == SMOLLM2 else None)
    profile = build_profile(
        model.config, traces, settings, ClassifySettings(fraction=args.fraction), model_name=args.model,
        model_info={"gguf_file": gguf_file} if gguf_file else {},
        calibration={"data": {spec: describe(spec) for spec in args.data},
                     "command": "examples/profile_model.py (see the settings below)"},
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(out)
    total = profile.num_layers * profile.num_kv_heads
    print(f"\nwrote {out}: {len(profile.unstable_heads)} of {total} KV heads unstable")
    print("unstable (layer, head):", ", ".join(f"({layer},{head})" for layer, head in profile.unstable_heads))
    print(format_reports(profile.calibration["reports"]))
    if args.plots:
        from flexicache.profiling.plots import plot_profile

        for path in plot_profile(profile, args.plots, out.stem):
            print(f"wrote {path}")
    print(f"\nuse it: FlexiCache.from_model(model, profile=HeadProfile.load({str(out)!r}), token_budget=...)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
