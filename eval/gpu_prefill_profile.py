"""Where FlexiCache's prefill time goes on a CUDA GPU: page-locking host memory, and one layer's prefill.

Times 2 GiB of page-locked host memory from ``torch.zeros(..., pin_memory=True)`` (``cudaHostAlloc``) and from
:func:`flexicache.host_memory.pinned_zeros` (allocation and freeing), copies into and out of the latter, then the
prefill (``update`` + ``commit``) of Llama-3.1-8B-shaped layers of ``--context`` tokens x batch ``--batch`` one
after another, the last under the torch profiler (tables by CUDA and by CPU time). With ``--online-split`` the cache
has no profile (the library's default): each layer's commit first estimates its head split from the last
:data:`~flexicache.head_split.WINDOW` queries of the prompt.

With ``--chunk N`` the layers' prefill runs as a chunked forward does it (each chunk of ``N`` tokens through every
layer, all chunks of a layer in one cache), every chunk timed, the last one also under cProfile (host time by
function: where growing the cache's buffers costs).

Usage: ``python eval/gpu_prefill_profile.py [--context 32768] [--batch 8] [--layers 6] [--chunk 4096]
[--online-split]``
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from flexicache import FlexiCache, handoff
from flexicache.benchmarks.attention import Shape, random_profile
from flexicache.benchmarks.suite import empty_pinned_cache
from flexicache.head_split import WINDOW
from flexicache.host_memory import pinned_zeros

GIB = 2**30


def timed(work: Callable[[], Any]) -> tuple[Any, float]:
    """``work()``'s result and its milliseconds, the device synchronised before and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = work()
    torch.cuda.synchronize()
    return result, 1000 * (time.perf_counter() - start)


def page_locking() -> None:
    for name, allocate in (("torch.zeros(pin_memory=True)", lambda: torch.zeros(2 * GIB, dtype=torch.uint8,
                                                                                  pin_memory=True)),
                           ("pinned_zeros", lambda: pinned_zeros((2 * GIB,), torch.uint8))):
        memory, allocate_ms = timed(allocate)
        start = time.perf_counter()
        del memory
        empty_pinned_cache()  # torch's allocator would keep the pinned block cached
        free_ms = 1000 * (time.perf_counter() - start)
        print(f"{name} 2 GiB: allocate {allocate_ms:.0f} ms, free {free_ms:.0f} ms")
    device = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
    host = pinned_zeros((2 * GIB,), torch.uint8)
    _, to_host = timed(lambda: host.copy_(device, non_blocking=True))
    _, to_device = timed(lambda: device.copy_(host, non_blocking=True))
    print(f"2 GiB device -> pinned_zeros {to_host:.0f} ms, pinned_zeros -> device {to_device:.0f} ms")


def chunked_prefill(cache: FlexiCache, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor,
                    chunk: int) -> None:
    """Prefill every layer of ``cache`` with ``keys``/``values`` ``[B, H, L, D]`` in chunks of ``chunk`` tokens,
    timing each chunk (all layers) and profiling the last one's host side."""
    starts = list(range(0, keys.shape[2], chunk))

    def run_chunk(start: int) -> None:
        for index, layer in enumerate(cache.layers):
            layer.update(keys[:, :, start:start + chunk], values[:, :, start:start + chunk])
            layer.commit(handoff.take(index), query, None)

    for start in starts[:-1]:
        _, ms = timed(lambda start=start: run_chunk(start))
        print(f"chunk at {start}: {ms:.0f} ms ({len(cache.layers)} layers)")
    host = cProfile.Profile()
    host.enable()
    _, ms = timed(lambda: run_chunk(starts[-1]))
    host.disable()
    print(f"chunk at {starts[-1]} under cProfile: {ms:.0f} ms")
    out = io.StringIO()
    pstats.Stats(host, stream=out).sort_stats("tottime").print_stats(30)
    print(out.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--chunk", type=int, default=0, help="prefill in chunks of this many tokens (0: one)")
    parser.add_argument("--online-split", action="store_true", help="no profile: each layer estimates its head split")
    args = parser.parse_args()
    page_locking()
    shape = Shape(num_layers=args.layers)
    torch.manual_seed(0)
    head_profile = None if args.online_split else random_profile(shape, 0.25)
    cache = FlexiCache(shape.config(), profile=head_profile, token_budget=1024)
    query = torch.randn(args.batch, shape.num_kv_heads * shape.group, WINDOW if args.online_split else 1,
                        shape.head_dim, dtype=torch.bfloat16, device="cuda")
    keys = torch.randn(args.batch, shape.num_kv_heads, args.context, shape.head_dim, dtype=torch.bfloat16,
                       device="cuda")
    values = torch.randn_like(keys)

    def prefill(index: int) -> None:
        layer = cache.layers[index]
        layer.update(keys, values)
        layer.commit(handoff.take(index), query, None)

    if args.chunk:
        chunked_prefill(cache, keys, values, query, args.chunk)
        return
    for index in range(args.layers - 1):  # the first includes compiling the kernels
        _, ms = timed(lambda index=index: prefill(index))
        print(f"layer {index} prefill (update + commit) {ms:.0f} ms")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiled:
        _, ms = timed(lambda: prefill(args.layers - 1))
    print(f"layer {args.layers - 1} prefill under the profiler {ms:.0f} ms")
    print(profiled.key_averages().table(sort_by="cuda_time_total", row_limit=18))
    print(profiled.key_averages().table(sort_by="cpu_time_total", row_limit=22))


if __name__ == "__main__":
    main()
