"""Memory and failure behaviour of FlexiCache over a service's life, on one GPU.

Builds a random-weight model of a real shape (``--shape``, Llama-3.1-8B by default, ``--layers`` of its decoder
layers), bf16, and then:

1. ``--requests`` sequential requests, each with a fresh ``FlexiCache.from_model`` cache (``--batch`` random
   prompts of ``--context`` tokens, ``--new-tokens`` greedy tokens, ``--budget`` tokens per head), the cache dropped
   after its generate and no ``gc.collect()``: after each, the process's resident memory (RSS), its locked memory,
   the device memory allocated and reserved, the pinned host pool's bytes in use and registered, and the time from
   the prompt to the last token (the first request registers the host tiers; the later ones reuse the pool's
   blocks);
2. ``warm_up`` with the same shapes, then one more request, timed the same way;
3. the error a request gets when the pool's limit (``--small-limit-gib``) is below what its host tiers need: the
   request is refused before any host memory is taken.

Also prints the locked-memory limit (``ulimit -l``) beside the bytes the pool registered: FlexiCache does not enforce
it (see flexicache.host_limits), and this shows whether the process registered more than it. Sizes are arguments so
that a run fits the time available (e.g. ``--layers 8 --context 8192``); ``--device cpu --shape tiny-llama`` runs
every step on the CPU as a smoke test (no page-locked tier there: step 3 is skipped).

Usage: ``python eval/gpu_reliability.py [--layers 32] [--context 32768] [--batch 8] [--budget 1024] [--out r.json]``
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from flexicache import FlexiCache, host_pool, warm_up
from flexicache.benchmarks.attention import Shape, random_profile
from flexicache.benchmarks.measure import build_model, random_ids, synchronize
from flexicache.benchmarks.suite import MODEL_SHAPES, full_layers, model_config
from flexicache.host_limits import GIB, HostMemoryError, memlock_limit
from flexicache.models import cache_keyword


def process_memory() -> dict[str, int]:
    """``rss_bytes`` and ``locked_bytes`` of this process (``/proc/self/status``; 0 where it is not readable)."""
    fields = {"VmRSS": "rss_bytes", "VmLck": "locked_bytes"}
    values = dict.fromkeys(fields.values(), 0)
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in fields:
                values[fields[name]] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return values


def snapshot(device: torch.device) -> dict[str, int]:
    """Host and device memory now, and the pinned pool's state."""
    state = {**process_memory(), **host_pool.host_pool().stats()}
    if device.type == "cuda":
        synchronize(device)
        state["device_allocated_bytes"] = torch.cuda.memory_allocated(device)
        state["device_reserved_bytes"] = torch.cuda.memory_reserved(device)
    return state


def request(model: Any, ids: torch.Tensor, settings: dict[str, Any], new_tokens: int) -> dict[str, Any]:
    """One request with a fresh cache, dropped at the end (no garbage collection): its time and the cache's
    stats."""
    cache = FlexiCache.from_model(model, **settings)
    synchronize(ids.device)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, **{cache_keyword(model): cache})
    synchronize(ids.device)
    seconds = time.perf_counter() - start
    stats = cache.stats()
    del cache
    return {"seconds": seconds, "host_reserved_bytes": stats["host_reserved_bytes"],
            "device_reserved_bytes_cache": stats["device_reserved_bytes"], "decode_steps": stats["decode_steps"]}


def gib(nbytes: int) -> str:
    return f"{nbytes / GIB:7.2f} GiB"


def show(label: str, row: dict[str, Any]) -> None:
    parts = [f"{label:<18}", f"RSS {gib(row['rss_bytes'])}", f"locked {gib(row['locked_bytes'])}",
             f"pool in use {gib(row['host_pool_in_use_bytes'])}",
             f"pool registered {gib(row['host_pool_reserved_bytes'])}"]
    if "device_allocated_bytes" in row:
        parts += [f"device allocated {gib(row['device_allocated_bytes'])}",
                  f"device reserved {gib(row['device_reserved_bytes'])}"]
    if "seconds" in row:
        parts.append(f"prompt to last token {row['seconds']:.2f} s")
    if "warm_up_seconds" in row:
        parts.append(f"warm_up {row['warm_up_seconds']:.2f} s")
    print(" | ".join(parts), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: all of the shape's)")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--unstable-fraction", type=float, default=0.25)
    parser.add_argument("--small-limit-gib", type=float, default=1.0)
    parser.add_argument("--skip-warm-up", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    device = torch.device(args.device)
    layers = args.layers or full_layers(args.shape)
    config = model_config(args.shape, layers)
    model = build_model(config, device, torch.bfloat16, seed=0)
    settings = {"profile": random_profile(Shape.of(config), args.unstable_fraction), "token_budget": args.budget,
                "max_cache_len": args.context + args.new_tokens,
                "backend": "auto" if device.type == "cuda" else "reference"}
    ids = random_ids(args.batch, args.context, config.vocab_size, device, seed=1)
    limit = memlock_limit()
    print(f"{args.shape}, {layers} layers, batch {args.batch} x {args.context} tokens, budget {args.budget}; "
          f"ulimit -l: {'unlimited' if limit is None else gib(limit)}", flush=True)
    rows: dict[str, Any] = {"start": snapshot(device)}
    show("start", rows["start"])
    for index in range(args.requests):
        row = request(model, ids, settings, args.new_tokens)
        rows[f"request {index + 1}"] = {**row, **snapshot(device)}
        show(f"after request {index + 1}", rows[f"request {index + 1}"])
    if not args.skip_warm_up:
        warmed = warm_up(model, args.context, args.batch, **settings)
        rows["warm_up"] = {"warm_up_seconds": warmed["seconds"], **snapshot(device)}
        show("after warm_up", rows["warm_up"])
        row = request(model, ids, settings, args.new_tokens)
        rows["after warm_up"] = {**row, **snapshot(device)}
        show("request after it", rows["after warm_up"])
    if device.type == "cuda":
        pool = host_pool.host_pool()
        pool.release()  # what the requests left registered goes, so that the limit below binds
        host_pool.set_limit(args.small_limit_gib)
        message = None
        try:
            request(model, ids, settings, args.new_tokens)
        except HostMemoryError as error:
            message = str(error)  # the snapshot comes after the except block: its traceback holds the prefill
        finally:
            host_pool.set_limit(None)
        rows["small limit"] = {"error": message, **snapshot(device)}
        if message is None:
            print(f"at a {args.small_limit_gib} GiB limit the request ran (its host tiers fit)")
        else:
            print(f"at a {args.small_limit_gib} GiB pool limit the request is refused:\n  {message}")
        show("after the refusal" if message else "after it", rows["small limit"])
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
