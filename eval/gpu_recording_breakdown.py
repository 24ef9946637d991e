"""Where the time of a whole-step CUDA graph recording goes (:mod:`flexicache.step_graph`), on a random-weight model.

A new FlexiCache records one whole-step graph per rerank phase (16 with the default ``rerank_interval``) in its first
decode steps; each recording runs the step's forward once eagerly, then captures it. This script runs one greedy
``generate`` with ``FlexiCache.from_model`` and times, for every recording (the device synchronised around each part):

- ``eager_ms``: the step's own work: its forward run once in recording mode, or the fresh graph's replay;
- ``capture_ms``: the same forward under stream capture (host work only: nothing runs);
- ``instantiate_ms``: ``capture_end``, which ends the capture and instantiates the graph (host time);

beside the median replayed step (``replay_step_ms``). A cache's recordings after its first replay their fresh graph
for the step's work, so their ``eager_ms`` is that replay; ``--eager-first`` makes every recording run the step's
forward eagerly before it captures (``StepGraphStore.captures_at_once`` off). Usage: ``python
eval/gpu_recording_breakdown.py [--shape llama-3.1-8b] [--layers N] [--context 8192] [--batch 4] [--new-tokens 40]
[--eager-first] [--out r.json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import StoppingCriteriaList

from flexicache import FlexiCache, step_graph
from flexicache.benchmarks.measure import StepClock, build_model, random_ids
from flexicache.benchmarks.suite import MODEL_SHAPES, model_config


def timed(function: Callable[..., Any], device: torch.device | None, into: list[float]) -> Callable[..., Any]:
    """``function`` that appends its milliseconds to ``into``, ``device`` synchronised before and after (``None``:
    host time only, for a call made while a stream captures, where a synchronisation is not allowed)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        if device is not None:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            if device is not None:
                torch.cuda.synchronize(device)
            into.append((time.perf_counter() - start) * 1000)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's all)")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--eager-first", action="store_true",
                        help="every recording runs the step's forward eagerly before it captures")
    parser.add_argument("--out", default=None, help="write the breakdown as JSON here")
    args = parser.parse_args()
    device = torch.device("cuda")
    config = model_config(args.shape, args.layers)
    model = build_model(config, device, torch.bfloat16, seed=0, step_graphs=False)
    ids = random_ids(args.batch, args.context, config.vocab_size, device, seed=1)
    records: list[float] = []
    captures: list[float] = []
    instantiations: list[float] = []
    original = step_graph._record, step_graph.capture, torch.cuda.CUDAGraph.capture_end
    step_graph._record = timed(step_graph._record, device, records)
    step_graph.capture = timed(step_graph.capture, device, captures)
    torch.cuda.CUDAGraph.capture_end = timed(torch.cuda.CUDAGraph.capture_end, None, instantiations)
    try:
        runs = {}
        for run in ("warm-up", "timed"):  # the first compiles the kernels and FlashInfer's modules
            records.clear(), captures.clear(), instantiations.clear()
            clock = StepClock(device)
            cache = FlexiCache.from_model(model, token_budget=args.budget)
            cache.step_graphs.captures_at_once = not args.eager_first
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                               max_new_tokens=args.new_tokens, do_sample=False,
                               stopping_criteria=StoppingCriteriaList([clock]))
            runs[run] = clock.step_ms()[1:], cache.stats()
    finally:
        step_graph._record, step_graph.capture, torch.cuda.CUDAGraph.capture_end = original
    step_ms, stats = runs["timed"]
    # the whole-step captures only (the layers' own graphs of the first decode step are not recordings)
    instantiations = instantiations[-len(captures):] if captures else []
    rows = [{"record_ms": round(total, 2), "eager_ms": round(total - capture, 2),
             "capture_ms": round(capture - instantiate, 2), "instantiate_ms": round(instantiate, 2)}
            for total, capture, instantiate in zip(records, captures, instantiations)]
    replayed = step_ms[len(records) + 1:]
    result = {"shape": args.shape, "layers": config.num_hidden_layers, "batch": args.batch, "context": args.context,
              "budget": args.budget, "new_tokens": args.new_tokens, "eager_first": args.eager_first,
              "device": torch.cuda.get_device_name(device),
              "torch": torch.__version__, "recordings": rows, "captures": stats["step_graph_captures"],
              "replays": stats["step_graph_replays"],
              "replay_step_ms": round(statistics.median(replayed), 2) if replayed else None,
              "step_ms": [round(ms, 2) for ms in step_ms]}
    for name in ("record_ms", "eager_ms", "capture_ms", "instantiate_ms"):
        values = [row[name] for row in rows]
        result[f"median_{name}"] = round(statistics.median(values), 2) if values else None
    print(json.dumps({key: value for key, value in result.items() if key not in ("recordings", "step_ms")}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
