"""GPU: the decode step with ``head_budgets="prompt"`` against the same cache with ``K`` pages for every head.

``--layers`` layers of the ``--shape`` (Llama-3.1-8B, all 32 by default) with random weights, ``--batch`` x
``--context`` random keys and values (:func:`flexicache.benchmarks.measure.fill_cache`), ``--budget`` tokens per
head, no profile, whole-step CUDA graphs (``from_model``). Random keys and queries give every head the same attention
spread, so a split made from them would be nearly even; each layer's split is drawn instead with a spread like
SmolLM2-135M's real one (``typing.py``, budget 128 of 1024: each head's share of ``K`` from 0.31 to 2.0, median
0.94, the middle 80% from 0.56 to 1.56): head ``h``'s page gains decay as ``exp(-j / (s_h K))`` with ``s_h``
log-normal (sigma :data:`SPREAD_SIGMA`), and :func:`flexicache.head_budgets.split_budget` splits the layer's pages
from them within the option's bounds (one split per layer, the same for every request). Both caches decode
``--steps`` greedy steps after ``--warmup``, ``--rounds`` times in alternating order; each one's step p50 (over its
rounds' pooled steps) and their ratio go to ``--out`` (JSON), with the drawn shares.

Usage: ``python eval/gpu_head_budgets.py [--context 32768] [--batch 8] [--budget 1024] [--out r.json]``;
``--device cpu --shape tiny-llama --context 512 --batch 2 --budget 64 --steps 4 --warmup 2 --rounds 1`` is a smoke
test (the CPU path).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from flexicache import FlexiCache, head_budgets
from flexicache.benchmarks.measure import build_model, fill_cache, summarize, timed_generate
from flexicache.benchmarks.suite import model_config
from flexicache.benchmarks.suite import release as release_memory

SPREAD_SIGMA = 0.4  # log-normal spread of head widths: shares of K like SmolLM2's (10%, 50%, 90%: 0.56, 0.97, 1.5)


class DrawnSplits:
    """A stand-in for :func:`flexicache.head_budgets.prompt_row_pages` that splits each layer's pages by drawn page
    gains (see the module docstring), recording the shares of ``K`` it gave."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.shares: list[list[float]] = []

    def __call__(self, gains: torch.Tensor, settings: Any, unstable_heads: list[int]) -> torch.Tensor:
        batch, heads, width = gains.shape
        k = settings.pages_per_head
        spread = torch.exp(SPREAD_SIGMA * torch.randn(heads, 1, generator=self.generator, dtype=torch.float64))
        drawn = torch.exp(-torch.arange(width, dtype=torch.float64).view(1, -1) / (spread * k))
        unstable = torch.zeros(heads, dtype=torch.bool)
        unstable[unstable_heads] = True
        pages = head_budgets.split_budget(drawn, heads * k, *head_budgets.row_bounds(settings, unstable))
        self.shares.append((pages.double() / k).tolist())
        return pages.repeat(batch, 1)


def run_rounds(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Alternating rounds of the two caches; their pooled step statistics and the drawn shares."""
    steps: dict[str, list[float]] = {"uniform": [], "prompt": []}
    splits = DrawnSplits(args.seed)
    original = head_budgets.prompt_row_pages
    head_budgets.prompt_row_pages = splits
    try:
        for round_index in range(args.rounds):
            order = ["uniform", "prompt"] if round_index % 2 == 0 else ["prompt", "uniform"]
            for name in order:
                cache = FlexiCache.from_model(model, token_budget=args.budget, head_budgets=name)
                ids = fill_cache(model, cache, args.batch, args.context, args.seed)
                sequences, _ = timed_generate(model, cache, ids, args.warmup)
                _, step_ms = timed_generate(model, cache, sequences, args.steps + 1)
                steps[name] += step_ms[1:]  # a generate call's first step carries its set-up
                print(f"round {round_index} {name}: p50 {summarize(step_ms[1:])['step_ms_p50']:.2f} ms", flush=True)
                del cache, ids, sequences
                release_memory(model.device)
    finally:
        head_budgets.prompt_row_pages = original
    rows = {name: summarize(samples) for name, samples in steps.items()}
    return {"rows": rows, "ratio_p50": rows["prompt"]["step_ms_p50"] / rows["uniform"]["step_ms_p50"],
            "shares": splits.shares}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's all)")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(model_config(args.shape, args.layers), device, dtype, args.seed)
    result = {"shape": args.shape, "layers": model.config.num_hidden_layers, "context": args.context,
              "batch": args.batch, "budget": args.budget, "steps": args.steps, "rounds": args.rounds,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              **run_rounds(model, args)}
    print(json.dumps({key: value for key, value in result.items() if key != "shares"}, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
