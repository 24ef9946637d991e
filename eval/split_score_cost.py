"""CPU time of the online head split's two scores for one layer, side by side in one run (their ratio is what to read;
absolute times belong to the GPU host): ``request_stability`` with ``split_score="staleness"`` and ``"overlap"`` on
random fp32 tensors of one layer of the Llama-3.1-8B shape (32 query heads, 8 KV heads, head dim 128), one request,
the prompt's last 64 queries, budget 1/8 of the context, 8-token pages, the mean of three calls after a warm-up.

Usage: ``python eval/split_score_cost.py [--contexts 4096 16384]``.
"""

from __future__ import annotations

import argparse
import time

import torch

from flexicache.config import FlexiCacheConfig
from flexicache.head_split import WINDOW, request_stability


def seconds(query: torch.Tensor, keys: torch.Tensor, settings: FlexiCacheConfig, calls: int = 3) -> float:
    request_stability(query, keys, None, settings)  # warm-up
    start = time.perf_counter()
    for _ in range(calls):
        request_stability(query, keys, None, settings)
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="*", default=[4096, 16384])
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    for context in args.contexts:
        query = torch.randn(1, 32, WINDOW, 128, generator=generator)
        keys = torch.randn(1, 8, context, 128, generator=generator)
        times = {score: seconds(query, keys, FlexiCacheConfig(token_budget=context // 8, split_score=score))
                 for score in ("staleness", "overlap")}
        print(f"context {context}: staleness / overlap = {times['staleness'] / times['overlap']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
