"""Where a whole-step-graph decode step of the attention layers spends its time, on a CUDA GPU.

Builds FlexiCache over ``--layers`` Llama-3.1-8B-shaped attention layers (8 KV heads, group 4, head dim 128, random
KV of ``--context`` tokens, batch ``--batch``, budget 1024, 25% unstable heads), runs decode steps as
``flexicache.benchmarks.attention`` does with ``step_graph=True``, and prints: the step's wall time, its host-issue
time, the times of the per-step bookkeeping of the cache's :class:`~flexicache.step_graph.StepGraphStore`
(``cache.step_graphs``: ``begin`` where a step records or follows other work, else ``prepare_replay`` before the
replay and ``finish_replay`` after it) and of the replayed graph alone on the GPU; then a torch-profiler table of the
kernels (``cuda_time_total``) and a cProfile of the host side.

Usage: ``python eval/gpu_step_profile.py [--layers 16] [--context 32768] [--batch 8] [--settings exact_rescore=true]``
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from flexicache import attention
from flexicache.benchmarks.attention import Module, Shape, prefilled_cache
from flexicache.setting_specs import parse_settings
from flexicache.step_graph import run_graphed_step

BOOKKEEPING = ("begin", "prepare_replay", "finish_replay")  # StepGraphStore methods timed per call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--settings", default="", help="FlexiCache keyword arguments, e.g. exact_rescore=true")
    args = parser.parse_args()
    shape, batch = Shape(num_layers=args.layers), args.batch
    torch.manual_seed(0)
    settings = parse_settings(args.settings, "--settings", "exact_rescore=true")
    cache, query = prefilled_cache(shape, batch, args.context, **settings)
    modules = [Module(index, shape) for index in range(args.layers)]
    token = torch.randn(batch, shape.num_kv_heads, 1, shape.head_dim, dtype=torch.bfloat16, device="cuda")

    def layers(inputs: dict[str, torch.Tensor]) -> None:
        for module in modules:
            keys, values = cache.layers[module.layer_idx].update(inputs["keys"], inputs["values"])
            attention.flexicache_attention_forward(module, inputs["query"], keys, values, None, scaling=0.1)

    def step() -> None:
        inputs = {"keys": token, "values": token, "query": query}
        if cache.step_graphs.eager_reason is None and cache.step_graphs.ready():
            run_graphed_step(cache, ("attention layers",), inputs, layers)
        else:
            layers(inputs)

    for _ in range(40):
        step()
    torch.cuda.synchronize()
    bookkeeping_ms: dict[str, list[float]] = {}

    def timed(name: str, work):  # the step-graph store's bookkeeping methods, each call timed on the host
        def run(*args):
            start = time.perf_counter()
            result = work(*args)
            bookkeeping_ms.setdefault(name, []).append(1000 * (time.perf_counter() - start))
            return result
        return run

    store = cache.step_graphs
    originals = {name: getattr(store, name) for name in BOOKKEEPING}
    for name in BOOKKEEPING:
        setattr(store, name, timed(name, originals[name]))
    host_ms, wall_ms = [], []
    for _ in range(64):
        start = time.perf_counter()
        step()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        host_ms.append(1000 * (issued - start))
        wall_ms.append(1000 * (time.perf_counter() - start))
    for name in BOOKKEEPING:
        delattr(store, name)
    median = statistics.median
    print(f"layers {args.layers}, settings {settings or 'defaults'}: step wall ms p50 {median(wall_ms):.3f}, "
          f"host issue p50 {median(host_ms):.3f}")
    for name in BOOKKEEPING:  # prepare_replay precedes the replay, finish_replay follows it (overlapping the GPU)
        if name in bookkeeping_ms:
            times = bookkeeping_ms[name]
            print(f"  {name}: {len(times)} calls, p50 {median(times):.3f} ms "
                  f"({1000 * median(times) / args.layers:.1f} us/layer)")
    # Replaying one recorded step out of sequence repeats its writes (a token, counters): fine for timing only.
    recorded = next(iter(store.steps.values()))
    start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start_event.record()
    for _ in range(20):
        recorded.graph.replay()
    end_event.record()
    torch.cuda.synchronize()
    print(f"replay alone (GPU, one recorded step) ms {start_event.elapsed_time(end_event) / 20:.3f}")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as kernels:
        for _ in range(16):
            step()
        torch.cuda.synchronize()
    print(kernels.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    host = cProfile.Profile()
    host.enable()
    for _ in range(64):
        step()
    torch.cuda.synchronize()
    host.disable()
    out = io.StringIO()
    stats = pstats.Stats(host, stream=out)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(45)
    print(out.getvalue())


if __name__ == "__main__":
    main()
