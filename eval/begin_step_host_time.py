"""Host time of a whole-step graph's bookkeeping (``cache.step_graphs.begin()``) on the CPU, no GPU needed.

With whole-step CUDA graphs the GPU waits for this bookkeeping at every decode step, so it bounds how far a step can
shrink. This script builds a 32-layer model with tiny dimensions (the bookkeeping depends on the layer count, not on
the sizes), puts its cache on the graph path with the CUDA-only parts replaced (the Triton launches by no-ops,
FlashInfer by the torch stand-in of tests/test_triton_interpreted.py, whose ``prepare`` copies more than
FlashInfer's does when the plan is reused), and times ``step_graphs.ready()`` + ``step_graphs.begin()`` over 64
steps, then the split a replayed step takes after another one: ``ready()`` + ``prepare_replay()`` (before the replay)
and ``finish_replay()`` + ``prepare_next_step()`` (after it, while the GPU works).

Usage: ``PYTHONPATH=src python eval/begin_step_host_time.py [--layers 32] [--batch 8] [--profile]``
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_triton_interpreted import FlashInferStandIn

from flexicache import FlexiCache, HeadProfile, backends, decode_graph, decode_paths, offload
from flexicache.backends import triton_exact, triton_rerank, triton_select, triton_transfer


def graph_path_on_cpu() -> None:
    """Route the cache through the CUDA graph path on CPU tensors, every device launch a no-op."""
    torch.cuda.synchronize = lambda *args, **kwargs: None
    for module, name in ((triton_select, "append_token"), (triton_select, "decode_table"),
                         (triton_exact, "exact_decode_table"),
                         (triton_transfer, "copy_pages"), (triton_transfer, "retire_tails"),
                         (triton_transfer, "write_tokens"), (triton_transfer, "open_pages")):
        setattr(module, name, lambda *args, **kwargs: None)
    triton_rerank.rerank_rows = lambda *args, **kwargs: torch.zeros(1, dtype=torch.long)
    triton_select.stable_page_scores = lambda query, *args: torch.zeros(query.shape[0], args[4])  # [rows, width]
    decode_paths.fused_kernels_available = lambda device, head_dim: True
    offload.zero_copy_available = lambda device: True
    backends.resolve_backend = lambda name, device, dtype, head_dim: FlashInferStandIn([])
    decode_graph.DecodeGraph.run = lambda self, launch, storage_key: (launch(), self.output)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--profile", action="store_true", help="also print a cProfile of 32 steps")
    args = parser.parse_args()
    graph_path_on_cpu()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=args.layers,
                         num_attention_heads=8, num_key_value_heads=8, head_dim=8)
    model = LlamaForCausalLM(config).eval()
    unstable = [(layer, head) for layer in range(args.layers) for head in (0, 5)]  # 25% of the KV heads
    flexi = FlexiCache.from_model(model, profile=HeadProfile(args.layers, 8, 8, unstable), token_budget=64)
    ids = torch.randint(0, 64, (args.batch, 600))
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=flexi, max_new_tokens=2,
                       do_sample=False)

        store = flexi.step_graphs

        def step() -> None:
            store.ready()
            store.begin()

        times = []
        for _ in range(64):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        times.sort()
        print(f"begin step, {args.layers} layers, batch {args.batch}: p50 {1e3 * times[32]:.3f} ms, p90 "
              f"{1e3 * times[57]:.3f} ms, {1e6 * times[32] / args.layers:.1f} us per layer (p50)")
        # A step that replays a recorded graph after another one: prepare_replay before the replay (the GPU waits
        # for it), finish_replay and prepare_next_step after it (overlapping the replay on a GPU).
        _, storage = zip(*store.begin())
        before_replay, after_replay = [], []
        for _ in range(64):
            start = time.perf_counter()
            store.ready()
            prepared = store.prepare_replay(storage)
            middle = time.perf_counter()
            if prepared is None:  # a reservation reallocated: the full path, as run_graphed_step takes it
                _, storage = zip(*store.begin())
            else:
                store.finish_replay(prepared[1])
            store.prepare_next_step()
            before_replay.append(middle - start)
            after_replay.append(time.perf_counter() - middle)
        for name, times in (("prepare_replay", before_replay), ("finish_replay + prepare_next_step", after_replay)):
            times.sort()
            print(f"{name}: p50 {1e3 * times[32]:.3f} ms, p90 {1e3 * times[57]:.3f} ms, "
                  f"{1e6 * times[32] / args.layers:.1f} us per layer (p50)")
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(32):
                step()
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
