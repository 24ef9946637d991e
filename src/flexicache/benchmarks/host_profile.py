"""Where a decode step's host time goes: per-step times (which steps spike), host time per call of the attention
path's parts, and a cProfile of ``generate``.

    python -m flexicache.benchmarks.host_profile --device cuda --layers 32 --context 32768 --batch 8

Builds a random-weight model of ``--model``'s shape, fills a cache with random keys/values (as the decode case
does), runs ``--warmup`` steps, times ``--steps`` steps (device synchronised after each; the step index of every
step slower than 1.3x the median is listed with its time) with the functions of :data:`TIMED` wrapped by a
wall-clock timer (inclusive host time per call, no device synchronisation: what the host spends issuing), then
profiles ``--profile-steps`` more steps with cProfile (``--cprofile``), printing the functions with the most own
time, the FlexiCache functions by cumulative time and the callees of the attention path.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from flexicache import attention
from flexicache.backends.flashinfer import FlashInferBackend
from flexicache.benchmarks.measure import build_model, fill_cache, timed_generate
from flexicache.benchmarks.suite import Settings, System, model_config
from flexicache.decode_graph import DecodeGraph
from flexicache.decode_paths import GraphedDecode, TorchDecode
from flexicache.layer import FlexiLayer
from flexicache.offload import OffloadedPages
from flexicache.sequence import SequenceState
from flexicache.storage import LayerStorage

CALLEES = (r"flexicache_attention_forward|\(decode\)|decode_paths.py:\d+\(run\)|prepare_token_slots"
           r"|modeling_llama.py:\d+\(forward\)")


# (owner, method name): the host-side parts of a decode step worth timing one by one
TIMED = ((FlexiLayer, "update"), (FlexiLayer, "decode"), (LayerStorage, "prepare_token_slots"),
         (LayerStorage, "reserve_graphed_step"), (LayerStorage, "make_graphed_step_room"),
         (TorchDecode, "rerank_stable"), (GraphedDecode, "run"), (TorchDecode, "run"),
         (SequenceState, "plan_chunk"), (DecodeGraph, "load"), (DecodeGraph, "run"), (FlashInferBackend, "prepare"),
         (OffloadedPages, "retire_full_tails"), (OffloadedPages, "rerank"), (DynamicLayer, "update"))
ATTENTION_FUNCTIONS = {"sdpa": sdpa_attention_forward, attention.ATTENTION_NAME: attention.flexicache_attention_forward}


@contextmanager
def timed_calls(totals: dict[str, list[float]]) -> Iterator[None]:
    """Wrap :data:`TIMED` and the attention functions so that every call adds its wall time (s) to ``totals``."""

    def timer(name: str, function: Callable) -> Callable:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                totals[name].append(time.perf_counter() - start)
        return wrapped

    originals = [(owner, name, owner.__dict__[name]) for owner, name in TIMED if name in owner.__dict__]
    for owner, name, function in originals:
        setattr(owner, name, timer(f"{owner.__name__}.{name}", function))
    for key, function in ATTENTION_FUNCTIONS.items():
        AttentionInterface.register(key, timer(f"attention[{key}]", function))
    try:
        yield
    finally:
        for owner, name, function in originals:
            setattr(owner, name, function)
        for key, function in ATTENTION_FUNCTIONS.items():
            AttentionInterface.register(key, function)


def per_step_table(totals: dict[str, list[float]], steps: int) -> str:
    """Calls per step, median and mean microseconds per call, and milliseconds per step of each timed function."""
    lines = [f"{'function':40s} {'calls/step':>10s} {'median us':>10s} {'mean us':>10s} {'ms/step':>8s}"]
    for name, times in sorted(totals.items(), key=lambda item: -sum(item[1])):
        lines.append(f"{name:40s} {len(times) / steps:10.1f} {1e6 * statistics.median(times):10.1f} "
                     f"{1e6 * statistics.fmean(times):10.1f} {1e3 * sum(times) / steps:8.2f}")
    return "\n".join(lines)


def spikes(step_ms: list[float], factor: float = 1.3) -> list[tuple[int, float]]:
    """``(step index, ms)`` of every step slower than ``factor`` x the median."""
    median = statistics.median(step_ms)
    return [(index, round(ms, 2)) for index, ms in enumerate(step_ms) if ms > factor * median]


def profile_table(profiler: cProfile.Profile, sort: str, limit: int, only: str | None = None,
                  callees: str | None = None) -> str:
    """pstats' table sorted by ``sort`` (``only``: a regex on the function's file:line(name)), or the callees of
    the functions that match ``callees``."""
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream).sort_stats(sort)
    if callees is not None:
        stats.print_callees(callees)
    elif only is None:
        stats.print_stats(limit)
    else:
        stats.print_stats(only, limit)
    return stream.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--systems", nargs="+", default=["dynamic", "flexicache-1024"])
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--profile-steps", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--cprofile", action="store_true", help="also profile --profile-steps steps with cProfile")
    parser.add_argument("--json", help="write the per-step times here")
    args = parser.parse_args()

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    settings = Settings(device=args.device, models=[args.model], layers=args.layers, dtype=args.dtype)
    model = build_model(model_config(args.model, args.layers), device, dtype, settings.seed)
    results = {}
    for name in args.systems:
        system = System(name)
        model.set_attn_implementation(system.attn_implementation)
        total = args.context + args.warmup + args.steps + args.profile_steps + 4
        cache = system.make_cache(model.config, total, settings)
        ids = fill_cache(model, cache, args.batch, args.context, settings.seed)
        ids, _ = timed_generate(model, cache, ids, args.warmup)
        totals: dict[str, list[float]] = defaultdict(list)
        with timed_calls(totals):
            ids, step_ms = timed_generate(model, cache, ids, args.steps + 1)
        step_ms = step_ms[1:]
        table = per_step_table(totals, args.steps + 1)
        results[name] = {"step_ms": step_ms, "p50": statistics.median(step_ms), "spikes": spikes(step_ms),
                         "host_calls": table}
        print(f"== {name}: {args.layers} layers, context {args.context}, batch {args.batch}: p50 "
              f"{results[name]['p50']:.2f} ms, max {max(step_ms):.2f} ms; steps > 1.3x p50: {results[name]['spikes']}",
              flush=True)
        print(table, flush=True)
        if args.cprofile:
            profiler = cProfile.Profile()
            profiler.enable()
            timed_generate(model, cache, ids, args.profile_steps)
            profiler.disable()
            print(profile_table(profiler, "tottime", args.top), flush=True)
            print(profile_table(profiler, "cumulative", args.top, only="flexicache"), flush=True)
            print(profile_table(profiler, "cumulative", args.top, callees=CALLEES), flush=True)
        del cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
