"""Prompt to answer, as a user runs it: a real prefill, then greedy ``generate``, per system, in one process.

On a random-weight model of a real shape (``--shape``, all its layers by default), ``--batch`` random prompts of
``--context`` tokens each go through ``model.generate(..., max_new_tokens=--new-tokens)`` with:

- ``DynamicCache`` and ``StaticCache`` (``cache_implementation="static"``) on sdpa;
- ``FlexiCache(config=model.config, token_budget=...)`` on a model loaded with the flexicache attention and nothing
  else (the "two steps taken apart" of the README: the cache switches the model to whole-step graphs at its first
  decode step);
- ``FlexiCache.from_model(model, token_budget=...)`` (whole-step CUDA graphs), and the same for
  ``--long-tokens`` new tokens.

FlexiCache runs without a profile (the library's default: the head split estimated from the prompt over every layer;
``--unstable-fraction F``: a random profile instead, ``--standby-pages quarter``: another standby setting,
``--split-scores staleness overlap``: the FlexiCache rows once per online head ranking, the A/B of
``FlexiCacheConfig.split_score``; ``--skip-dense``: only the FlexiCache rows; ``--gc-freeze``: the long run again
after ``gc.freeze()``; ``--eager-first-recordings``: the ``from_model`` rows again with every whole-step graph
recording running its step eagerly before the capture, the A/B of recording a rerank phase at once,
:func:`flexicache.step_graph._record`). A stopping-criteria clock (the device synchronised) times every step: the
first interval is prompt to first token (the prefill), the rest are decode steps (p50, p99 and p99/p50). Peak device
memory is torch's allocator peak over the whole ``generate``. Each row also places every garbage collection and every
whole-step graph replay (its host and device milliseconds) in its decode step, to tell what makes a slow step slow.
One untimed FlexiCache request at full size goes first: the first request of a process page-locks its host tier (later
ones borrow the pool's blocks), and every system first runs one short untimed ``generate`` (kernel JIT, CUDA-graph
recording of the short shape).

Usage: ``python eval/gpu_end_to_end.py [--shape llama-3.1-8b] [--layers N] [--context 32768] [--batch 8] [--budget
1024] [--new-tokens 128] [--long-tokens 2000 (0: none)] [--split-scores staleness overlap] [--out r.json]``;
``--device cpu --shape tiny-llama --context 256 --batch 2 --budget 64 --new-tokens 4 --long-tokens 8`` is a smoke
test.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gc
import json
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache, StoppingCriteriaList

from flexicache import FlexiCache, FlexiCacheConfig, step_graph
from flexicache.attention import ATTENTION_NAME
from flexicache.benchmarks.attention import Shape, random_profile
from flexicache.benchmarks.measure import StepClock, build_model, peak, random_ids, reset_peak, summarize, synchronize
from flexicache.benchmarks.suite import MODEL_SHAPES, model_config
from flexicache.benchmarks.suite import release as release_memory
from flexicache.models import cache_keyword

GIB = 2**30


class GcClock:
    """Python's cyclic garbage collections while it is entered: count and milliseconds per generation, and every
    collection as ``(perf_counter at its start, generation, ms)``."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.ms = [0.0, 0.0, 0.0]
        self.events: list[tuple[float, int, float]] = []
        self._start = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        ms = (time.perf_counter() - self._start) * 1000
        self.count[info["generation"]] += 1
        self.ms[info["generation"]] += ms
        self.events.append((self._start, info["generation"], ms))

    def by_step(self, step_times: list[float]) -> list[tuple[int, int, float]]:
        """The collections inside decode steps as ``(decode step index, generation, ms)``; ``step_times``: the
        :class:`StepClock`'s times (prompt start, first token, then one per decode step)."""
        decode_starts = step_times[1:-1]
        return [(bisect.bisect_right(decode_starts, start) - 1, generation, round(ms, 2))
                for start, generation, ms in self.events if decode_starts and start >= decode_starts[0]]

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


class ReplayClock:
    """Every whole-step graph replay while it is entered (:func:`flexicache.step_graph._replay` wrapped): the host's
    ``perf_counter`` when the replay starts, and the device time from before its input copies to after its output
    copies (CUDA events). Tells a slow step's host time from its device time."""

    def __init__(self) -> None:
        self.replays: list[tuple[float, torch.cuda.Event, torch.cuda.Event]] = []
        self._original = step_graph._replay

    def _timed_replay(self, *args: Any) -> Any:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        host = time.perf_counter()
        start.record()
        output = self._original(*args)
        end.record()
        self.replays.append((host, start, end))
        return output

    def __enter__(self) -> ReplayClock:
        step_graph._replay = self._timed_replay
        return self

    def __exit__(self, *exc: object) -> None:
        step_graph._replay = self._original

    def by_step(self, step_times: list[float]) -> list[tuple[int, float, float]]:
        """``(decode step index, host ms from the step's start to its replay, device ms of the replay)`` per
        replay; ``step_times``: the :class:`StepClock`'s times (the device synchronised at each)."""
        torch.cuda.synchronize()
        decode_starts = step_times[1:-1]
        rows = []
        for host, start, end in self.replays:
            step = bisect.bisect_right(decode_starts, host) - 1
            if step >= 0:
                rows.append((step, round((host - decode_starts[step]) * 1000, 3), round(start.elapsed_time(end), 3)))
        return rows


def replay_summary(replays: list[tuple[int, float, float]], step_ms: list[float]) -> dict[str, Any]:
    """Median host and device milliseconds of the replayed steps, apart for the steps slower than 1.2x the median
    and the others (``step_ms``: the decode steps)."""
    median = statistics.median(step_ms)
    slow = [(host, device) for step, host, device in replays if step_ms[step] > 1.2 * median]
    others = [(host, device) for step, host, device in replays if step_ms[step] <= 1.2 * median]

    def medians(pairs: list[tuple[float, float]]) -> list[float] | None:
        return [round(statistics.median(p[i] for p in pairs), 3) for i in (0, 1)] if pairs else None

    return {"replay_host_device_ms_slow": medians(slow), "replay_host_device_ms_others": medians(others)}


def generate_steps(model: Any, ids: torch.Tensor, new_tokens: int, cache: Any = None, **kwargs: Any) -> StepClock:
    """The clock of one greedy ``generate`` into ``cache`` (its first step: prompt to first token)."""
    clock = StepClock(ids.device)
    if cache is not None:
        kwargs[cache_keyword(model)] = cache
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)  # StaticCache's and sdpa's notes
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                       stopping_criteria=StoppingCriteriaList([clock]), **kwargs)
    return clock


def slow_steps(step_ms: list[float]) -> dict[str, Any]:
    """Where a generation's tail sits: the decode steps slower than 1.2x the median (index 0: the first decode step
    after the prompt's), their count by index modulo 8 and 16 (a page fills every 8 tokens; stable heads rerank
    every 16 steps), and the slowest ten."""
    median = statistics.median(step_ms)
    slow = [i for i, ms in enumerate(step_ms) if ms > 1.2 * median]
    by_mod = {m: dict(sorted(collections.Counter(i % m for i in slow).items())) for m in (8, 16)}
    slowest = sorted(range(len(step_ms)), key=step_ms.__getitem__, reverse=True)[:10]
    return {"slow_steps": len(slow), "slow_steps_mod_8": by_mod[8], "slow_steps_mod_16": by_mod[16],
            "slowest_steps": [(i, round(step_ms[i], 2)) for i in slowest]}


def release(device: torch.device) -> None:
    """Collect what a finished ``generate`` left in reference cycles, then the suite's release of device memory."""
    gc.collect()
    release_memory(device)


def measure(name: str, model: Any, ids: torch.Tensor, new_tokens: int, warm_ids: torch.Tensor,
            cache_kwargs: Callable[[], dict[str, Any]], gc_freeze: bool = False) -> dict[str, Any]:
    """One system's row: a short untimed ``generate``, then the timed one (``gc_freeze``: with every object alive
    before it moved out of the cyclic collector's reach, ``gc.freeze()``)."""
    device = ids.device
    generate_steps(model, warm_ids, 4, **cache_kwargs())
    release(device)
    reset_peak(device)
    synchronize(device)
    if gc_freeze:
        gc.freeze()
    with GcClock() as collections_seen, ReplayClock() as replays:
        clock = generate_steps(model, ids, new_tokens, **cache_kwargs())
    step_ms = clock.step_ms()
    if gc_freeze:
        gc.unfreeze()
    gc_steps = collections_seen.by_step(clock.times)
    replayed = replays.by_step(clock.times) if device.type == "cuda" else []
    median = statistics.median(step_ms[1:])
    slow_with_gc = {i for i, _, _ in gc_steps if step_ms[1 + i] > 1.2 * median}
    row = {"system": name, "new_tokens": new_tokens, "prompt_to_first_token_s": step_ms[0] / 1000,
           **summarize(step_ms[1:]), "step_ms_max": max(step_ms[1:]), "peak_device_gib": (peak(device) or 0) / GIB,
           **slow_steps(step_ms[1:]), "gc_freeze": gc_freeze, "gc_collections": collections_seen.count,
           "gc_ms": [round(ms, 2) for ms in collections_seen.ms],
           "gc_by_step": gc_steps, "slow_steps_with_gc": len(slow_with_gc),
           **replay_summary(replayed, step_ms[1:]), "replays": replayed,
           "step_ms": [round(ms, 3) for ms in step_ms[1:]]}
    print(f"{name:<66} p50 {row['step_ms_p50']:7.2f} ms  p99 {row['step_ms_p99']:7.2f} ms  "
          f"(p99/p50 {row['p99_over_p50']:.2f}, max {row['step_ms_max']:.2f})  first token "
          f"{row['prompt_to_first_token_s']:6.2f} s  peak {row['peak_device_gib']:6.1f} GiB", flush=True)
    print(f"  steps > 1.2x median: {row['slow_steps']}, by index mod 16 {row['slow_steps_mod_16']}; slowest "
          f"{row['slowest_steps']}; garbage collections by generation {row['gc_collections']}, "
          f"{row['gc_ms']} ms, in {len(slow_with_gc)} of the slow steps; host/device ms of a replay: slow steps "
          f"{row['replay_host_device_ms_slow']}, others {row['replay_host_device_ms_others']}", flush=True)
    release(device)
    return row


def from_model_cache(model: Any, settings: dict[str, Any], captures_at_once: bool = True) -> dict[str, Any]:
    """``generate`` keywords with a ``FlexiCache.from_model`` cache; ``captures_at_once=False``: each of its
    whole-step graph recordings runs the step eagerly before it captures."""
    cache = FlexiCache.from_model(model, **settings)
    cache.step_graphs.captures_at_once = captures_at_once
    return {"cache": cache}


def flexicache_rows(model: Any, config: Any, ids: torch.Tensor, warm_ids: torch.Tensor, settings: dict[str, Any],
                    args: argparse.Namespace, suffix: str = "") -> list[dict[str, Any]]:
    """The FlexiCache rows of one setting: the plain cache, ``from_model`` and its long runs (``suffix``: added
    to every row's name)."""
    rows = [measure("FlexiCache(config) on the flexicache attention" + suffix, model, ids, args.new_tokens, warm_ids,
                    lambda: {"cache": FlexiCache(config=config, **settings)})]
    for at_once in (True, False) if args.eager_first_recordings else (True,):
        name = "FlexiCache.from_model(model) (whole-step graphs" + ("" if at_once else ", recorded eagerly first")
        rows.append(measure(name + ")" + suffix, model, ids, args.new_tokens, warm_ids,
                            lambda: from_model_cache(model, settings, at_once)))
        if not args.long_tokens:
            continue
        for freeze in (False, True) if args.gc_freeze else (False,):
            rows.append(measure(f"the same, {args.long_tokens} new tokens" + (", gc.freeze()" if freeze else "")
                                + suffix, model, ids, args.long_tokens, warm_ids,
                                lambda: from_model_cache(model, settings, at_once), freeze))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's all)")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--unstable-fraction", type=float, default=None,
                        help="FlexiCache rows with a random profile of this share of unstable heads (default: none)")
    parser.add_argument("--skip-dense", action="store_true", help="only the FlexiCache rows")
    parser.add_argument("--standby-pages", default=None,
                        help="FlexiCache's standby_pages (default: the library's, 'auto'), e.g. quarter or 0")
    parser.add_argument("--split-scores", nargs="+", default=[FlexiCacheConfig.split_score],
                        choices=["staleness", "overlap"], help="the FlexiCache rows once per online head ranking")
    parser.add_argument("--eager-first-recordings", action="store_true",
                        help="the from_model rows again with every recording running its step eagerly first")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="the long run again with gc.freeze() before it (objects alive then are never scanned)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    if args.unstable_fraction is not None and len(args.split_scores) > 1:
        parser.error("--split-scores ranks the heads of the online split: a random profile (--unstable-fraction) "
                     "has none; give one or the other")
    device = torch.device(args.device)
    config = model_config(args.shape, args.layers)
    model = build_model(config, device, torch.bfloat16 if device.type == "cuda" else torch.float32, seed=0,
                        step_graphs=False)
    ids = random_ids(args.batch, args.context, config.vocab_size, device, seed=1)
    warm_ids = ids[:, : min(args.context, 1024)]
    print(f"{args.shape}, {config.num_hidden_layers} layers, batch {args.batch} x {args.context} tokens, budget "
          f"{args.budget}, {args.new_tokens} new tokens ({args.long_tokens} for the long run)", flush=True)
    profile = None if args.unstable_fraction is None else random_profile(Shape.of(config), args.unstable_fraction)
    settings = {"profile": profile, "token_budget": args.budget}
    if args.standby_pages is not None:
        settings["standby_pages"] = int(args.standby_pages) if args.standby_pages.isdigit() else args.standby_pages
    start = time.perf_counter()
    rows = [] if args.skip_dense else [
        measure("DynamicCache + sdpa", model, ids, args.new_tokens, warm_ids,
                lambda: {"cache": DynamicCache(config=config)}),
        measure('StaticCache (cache_implementation="static") + sdpa', model, ids, args.new_tokens, warm_ids,
                lambda: {"cache_implementation": "static"}),
    ]
    model.set_attn_implementation(ATTENTION_NAME)
    generate_steps(model, ids, 2, cache=FlexiCache(config=config, **settings))  # page-locks the pool
    release(device)
    for split_score in args.split_scores:
        if profile is None:
            settings["split_score"] = split_score
        suffix = f" [split_score={split_score}]" if len(args.split_scores) > 1 else ""
        rows += flexicache_rows(model, config, ids, warm_ids, settings, args, suffix)
    print(f"total {time.perf_counter() - start:.0f} s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "shape": args.shape, "layers": config.num_hidden_layers, "context": args.context, "batch": args.batch,
            "budget": args.budget, "unstable_fraction": args.unstable_fraction,
            "standby_pages": args.standby_pages or "auto", "split_scores": args.split_scores,
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "rows": rows,
        }, indent=2))


if __name__ == "__main__":
    main()
