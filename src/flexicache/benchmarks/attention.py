"""Attention-layer decode time and device KV memory, side by side in one run (CUDA; ``bench_flexicache`` also runs
on the CPU, for the rerank ablation of ``flexicache bench``).

Systems, all on the same random keys/values of a model shape (default: Llama-3.1-8B, 8 KV heads, GQA 4, head
dim 128, bf16):
- ``dynamic_sdpa``: transformers ``DynamicLayer`` append + torch sdpa over the whole context;
- ``dense_flashinfer``: FlashInfer paged decode over every page (one plan per step);
- ``flexicache``: FlexiCache decode (append, scoring, reranks, promotions, sparse FlashInfer decode), each layer
  called from Python (each layer's work a replayed CUDA graph);
- ``flexicache_step_graph``: the same, the step's host bookkeeping then one replayed graph of all layers (what
  ``model.generate`` runs with ``from_model``'s whole-step graphs);
- ``quest_like``: FlexiCache with every head unstable (everything on the device, rerank every step).

Usage: ``python -m flexicache.benchmarks.attention --batch 8 --context 32768 --budget 1024 --out result.json``.
Times are per decode step and per layer, the median over ``--steps`` steps, from CUDA events: with fewer layers
than the rerank interval most steps hold no stable rerank (staggered over the layers), so the median leaves the
stable heads' reranks out; the rerank ablation (:mod:`flexicache.benchmarks.rerank`) measures them by the mean.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LlamaConfig
from transformers.cache_utils import DynamicLayer

from flexicache import FlexiCache, HeadProfile, attention, handoff
from flexicache.benchmarks.measure import nearest_rank_p99, synchronize
from flexicache.config import DEFAULT_UNSTABLE_FRACTION
from flexicache.step_graph import run_graphed_step


@dataclass
class Shape:
    num_layers: int = 4
    num_kv_heads: int = 8
    group: int = 4
    head_dim: int = 128

    @classmethod
    def of(cls, config: Any) -> Shape:
        """The attention shape of a model ``config`` (a decoder's layers, KV heads, GQA group and head dim)."""
        num_kv_heads = config.num_key_value_heads
        return cls(config.num_hidden_layers, num_kv_heads, config.num_attention_heads // num_kv_heads,
                   config.head_dim)

    def config(self) -> LlamaConfig:
        heads = self.num_kv_heads * self.group
        return LlamaConfig(num_hidden_layers=self.num_layers, num_attention_heads=heads,
                           num_key_value_heads=self.num_kv_heads, hidden_size=heads * self.head_dim,
                           head_dim=self.head_dim, vocab_size=32)


class Module:
    """Stand-in for an attention module: what the attention function reads from it."""

    def __init__(self, layer_idx: int, shape: Shape) -> None:
        self.layer_idx = layer_idx
        self.num_key_value_groups = shape.group
        self.scaling = shape.head_dim**-0.5
        self.is_causal = True
        self.training = False


def random_profile(shape: Shape, fraction: float, seed: int = 0) -> HeadProfile:
    """``fraction`` of each layer's KV heads unstable, chosen at random."""
    generator = torch.Generator().manual_seed(seed)
    per_layer = round(fraction * shape.num_kv_heads)
    unstable = [(layer, int(head)) for layer in range(shape.num_layers)
                for head in torch.randperm(shape.num_kv_heads, generator=generator)[:per_layer]]
    return HeadProfile(shape.num_layers, shape.num_kv_heads, shape.head_dim, unstable)


def prefilled_cache(shape: Shape, batch: int, context: int, budget: int = 1024,
                    unstable_fraction: float = DEFAULT_UNSTABLE_FRACTION,
                    **settings: Any) -> tuple[FlexiCache, torch.Tensor]:
    """A FlexiCache over ``shape``'s attention layers (random profile; ``settings``: further FlexiCache keyword
    arguments) holding ``context`` random bf16 tokens x ``batch`` on CUDA, prefilled layer by layer (one layer's KV
    on the device at a time), and the query ``[B, Hq, 1, D]`` that seeded the stable heads' selection (for the GPU
    profiling scripts under ``eval/``)."""
    cache = FlexiCache(shape.config(), profile=random_profile(shape, unstable_fraction), token_budget=budget,
                       **settings)
    query = torch.randn(batch, shape.num_kv_heads * shape.group, 1, shape.head_dim, dtype=torch.bfloat16,
                        device="cuda")
    for index, layer in enumerate(cache.layers):
        keys = torch.randn(batch, shape.num_kv_heads, context, shape.head_dim, dtype=torch.bfloat16, device="cuda")
        layer.update(keys, torch.randn_like(keys))
        layer.commit(handoff.take(index), query, None)
        del keys
    return cache, query


def time_steps(step: Callable[[int], None], first: int, steps: int, device: torch.device) -> dict[str, float]:
    """Median, mean and p99 step ms and median host-issue ms of ``step(first)`` ... ``step(first + steps - 1)``.

    On CUDA the step time comes from CUDA events around each call and the host-issue time is the wall time of the
    call itself; on the CPU both are the wall time. p99 is the nearest rank (as in the model-level cases: the
    slowest step when fewer than 100 are timed); the mean spreads periodic work (reranks) over the steps.
    """
    cuda = device.type == "cuda"
    synchronize(device)
    step_ms, host_ms = [], []
    for index in range(first, first + steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        host_start = time.perf_counter()
        step(index)
        host_ms.append(1000 * (time.perf_counter() - host_start))
        if cuda:
            end.record()
        synchronize(device)
        step_ms.append(start.elapsed_time(end) if cuda else host_ms[-1])
    step_ms.sort()
    return {"step_ms_p50": statistics.median(step_ms), "step_ms_mean": statistics.fmean(step_ms),
            "step_ms_p99": nearest_rank_p99(step_ms), "p99_rule": "nearest-rank",
            "timed_steps": len(step_ms), "host_issue_ms_p50": statistics.median(host_ms),
            "host_issue_ms_mean": statistics.fmean(host_ms)}


def warm_then_time(step: Callable[[int], None], steps: int, warmup: int, device: torch.device) -> dict[str, float]:
    for index in range(warmup):
        step(index)
    return time_steps(step, warmup, steps, device)


def bench_flexicache(shape: Shape, prompt: list[tuple[torch.Tensor, torch.Tensor]], new_tokens, queries,
                     profile: HeadProfile, budget: int, steps: int, warmup: int, rerank_interval: int = 16,
                     options: dict[str, Any] | None = None, step_graph: bool = False) -> dict:
    """FlexiCache decode steps of the attention layers alone (``queries[i % len(queries)]`` at step ``i``), with
    FlexiCache's defaults but for ``options`` (e.g. page size, standby pages, backend).

    ``step_graph``: each step is the cache's host bookkeeping plus one replayed CUDA graph of all layers'
    attention (:func:`flexicache.step_graph.run_graphed_step`, as ``model.generate`` runs it), instead of the
    layers' calls from Python. ``window`` holds the rerank and transfer counters of the timed steps only.
    """
    cache = FlexiCache(shape.config(), profile=profile, token_budget=budget, rerank_interval=rerank_interval,
                       **(options or {}))
    modules = [Module(index, shape) for index in range(shape.num_layers)]
    device = prompt[0][0].device
    last_query = queries[0][:, :, :1]
    for index, (keys, values) in enumerate(prompt):
        layer = cache.layers[index]
        layer.update(keys, values)
        layer.commit(handoff.take(index), last_query, real_tokens=None)
    synchronize(device)
    memory = cache.stats()

    def layers(inputs: dict[str, torch.Tensor]) -> None:
        for module in modules:
            out_keys, out_values = cache.layers[module.layer_idx].update(inputs["keys"], inputs["values"])
            attention.flexicache_attention_forward(module, inputs["query"], out_keys, out_values, None,
                                                   scaling=module.scaling)

    def step(index: int) -> None:
        keys, values = new_tokens[index % len(new_tokens)]
        inputs = {"keys": keys, "values": values, "query": queries[index % len(queries)]}
        if step_graph and cache.step_graphs.eager_reason is None and cache.step_graphs.ready():
            run_graphed_step(cache, ("attention layers",), inputs, layers)
        else:
            layers(inputs)

    for index in range(warmup):
        step(index)
    before = cache.stats()
    result = time_steps(step, warmup, steps, device)
    stats = cache.stats()
    result.update(device_kv_bytes=memory["device_kv_bytes"] + memory["device_metadata_bytes"],
                  host_kv_bytes=memory["host_kv_bytes"], dense_kv_bytes=memory["dense_kv_bytes"],
                  promoted_pages=stats["promoted_pages"], bytes_h2d=stats["bytes_h2d"],
                  reranks_stable=stats["reranks_stable"], reranks_unstable=stats["reranks_unstable"],
                  backend=stats["backend"], pages_per_head=cache.settings.pages_per_head,
                  standby_pages=cache.settings.num_standby_pages,
                  rerank_interval=rerank_interval, unstable_heads=len(profile.unstable_heads),
                  step_graph_replays=stats["step_graph_replays"],
                  window={name: stats[name] - before[name] for name in
                          ("reranks_stable", "reranks_unstable", "promoted_pages", "bytes_h2d", "decode_steps")})
    return result


def bench_dynamic_sdpa(shape: Shape, prompt, new_tokens, queries, steps: int, warmup: int) -> dict:
    layers = [DynamicLayer() for _ in range(shape.num_layers)]
    for layer, (keys, values) in zip(layers, prompt):
        layer.update(keys.clone(), values.clone())

    def step(index: int) -> None:
        keys, values = new_tokens[index % len(new_tokens)]
        query = queries[index % len(queries)]
        for layer in layers:
            all_keys, all_values = layer.update(keys, values)
            torch.nn.functional.scaled_dot_product_attention(query, all_keys, all_values, enable_gqa=True)

    result = warm_then_time(step, steps, warmup, prompt[0][0].device)
    result["device_kv_bytes"] = sum(layer.keys.nbytes + layer.values.nbytes for layer in layers)
    return result


def bench_dense_flashinfer(shape: Shape, prompt, queries, page_size: int, steps: int, warmup: int) -> dict:
    import flashinfer

    batch, num_kv_heads, length, head_dim = prompt[0][0].shape
    pages = (length + page_size - 1) // page_size
    pools = []
    for keys, values in prompt:
        padded = pages * page_size
        pool = torch.zeros(batch * pages, 2, page_size, num_kv_heads, head_dim, dtype=keys.dtype, device=keys.device)
        for part, tensor in enumerate((keys, values)):
            view = torch.zeros(batch, num_kv_heads, padded, head_dim, dtype=keys.dtype, device=keys.device)
            view[:, :, :length] = tensor
            pool[:, part] = view.view(batch, num_kv_heads, pages, page_size, head_dim).permute(0, 2, 3, 1, 4).reshape(
                batch * pages, page_size, num_kv_heads, head_dim)
        pools.append(pool)
    workspace = torch.zeros(128 * 2**20, dtype=torch.uint8, device=keys.device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
    indices = torch.arange(batch * pages, dtype=torch.int32, device=keys.device)
    last = torch.full((batch,), length - (pages - 1) * page_size, dtype=torch.int32)

    def step(index: int) -> None:
        query = queries[index % len(queries)][:, :, 0]
        wrapper.plan(indptr, indices, last, num_kv_heads * shape.group, num_kv_heads, head_dim, page_size,
                     q_data_type=query.dtype, kv_data_type=query.dtype)
        for pool in pools:
            wrapper.run(query, pool)

    result = warm_then_time(step, steps, warmup, keys.device)
    result["device_kv_bytes"] = sum(pool.nbytes for pool in pools)
    return result


ATTENTION_SYSTEMS = ("dense_flashinfer", "flexicache", "flexicache_step_graph", "quest_like", "dynamic_sdpa")


def run_attention_benchmark(batch: int, context: int, budget: int, shape: Shape, unstable_fraction: float,
                            steps: int, warmup: int, seed: int = 0, options: dict[str, Any] | None = None) -> dict:
    device = torch.device("cuda")
    torch.manual_seed(seed)
    dtype = torch.bfloat16
    kv_shape = (batch, shape.num_kv_heads, context, shape.head_dim)
    prompt = [(torch.randn(kv_shape, device=device, dtype=dtype), torch.randn(kv_shape, device=device, dtype=dtype))
              for _ in range(shape.num_layers)]
    token_shape = (batch, shape.num_kv_heads, 1, shape.head_dim)
    new_tokens = [(torch.randn(token_shape, device=device, dtype=dtype),
                   torch.randn(token_shape, device=device, dtype=dtype)) for _ in range(8)]
    queries = [torch.randn(batch, shape.num_kv_heads * shape.group, 1, shape.head_dim, device=device, dtype=dtype)
               for _ in range(8)]
    results = {"batch": batch, "context": context, "budget": budget, "layers": shape.num_layers,
               "kv_heads": shape.num_kv_heads, "group": shape.group, "head_dim": shape.head_dim,
               "unstable_fraction": unstable_fraction, "steps": steps, "warmup": warmup, "queries": len(queries),
               "gpu": torch.cuda.get_device_name()}
    results["dense_flashinfer"] = bench_dense_flashinfer(shape, prompt, queries, 16, steps, warmup)
    results["flexicache"] = bench_flexicache(shape, prompt, new_tokens, queries,
                                             random_profile(shape, unstable_fraction, seed), budget, steps, warmup,
                                             options=options)
    all_unstable = HeadProfile(shape.num_layers, shape.num_kv_heads, shape.head_dim,
                               [(l, h) for l in range(shape.num_layers) for h in range(shape.num_kv_heads)])
    results["flexicache_step_graph"] = bench_flexicache(shape, prompt, new_tokens, queries,
                                                        random_profile(shape, unstable_fraction, seed), budget, steps,
                                                        warmup, options=options, step_graph=True)
    results["quest_like"] = bench_flexicache(shape, prompt, new_tokens, queries, all_unstable, budget, steps, warmup,
                                             options=options)
    results["dynamic_sdpa"] = bench_dynamic_sdpa(shape, prompt, new_tokens, queries, steps, warmup)
    for name in ATTENTION_SYSTEMS:
        results[name]["layer_ms_p50"] = results[name]["step_ms_p50"] / shape.num_layers
    dense = results["dense_flashinfer"]["step_ms_p50"]
    results["speedup_vs_dense_flashinfer"] = {name: dense / results[name]["step_ms_p50"]
                                              for name in ATTENTION_SYSTEMS[1:]}
    results["device_kv_fraction_of_dynamic"] = (results["flexicache"]["device_kv_bytes"]
                                                / results["dynamic_sdpa"]["device_kv_bytes"])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[8])
    parser.add_argument("--context", type=int, nargs="+", default=[32768])
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--unstable-fraction", type=float, default=DEFAULT_UNSTABLE_FRACTION)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    shape = Shape(args.layers, args.kv_heads, args.group, args.head_dim)
    runs = []
    for context in args.context:
        for batch in args.batch:
            result = run_attention_benchmark(batch, context, args.budget, shape, args.unstable_fraction, args.steps,
                                             args.warmup)
            runs.append(result)
            print(f"batch {batch} context {context}: per layer ms p50 " + ", ".join(
                f"{name} {result[name]['layer_ms_p50']:.3f}" for name in ATTENTION_SYSTEMS)
                  + f" | flexicache host issue {result['flexicache']['host_issue_ms_p50'] / shape.num_layers:.3f}"
                  f" | speedup {result['speedup_vs_dense_flashinfer']['flexicache']:.2f}x, step graph "
                  f"{result['speedup_vs_dense_flashinfer']['flexicache_step_graph']:.2f}x"
                  f" | device KV {result['device_kv_fraction_of_dynamic']:.1%} of DynamicCache", flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(runs, handle, indent=2)


if __name__ == "__main__":
    main()
