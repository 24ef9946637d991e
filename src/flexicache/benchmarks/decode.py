"""Decode case: ``generate`` step latency (p50, p99) and tokens/s vs batch size and context, per system.

Each measurement fills the cache with random keys/values (no prefill forward), then runs greedy ``generate``:
``--warmup`` steps (first-step set-up, JIT, the host tier's first growth) and ``--steps`` timed steps, each timed
with a device synchronisation. With ``--decode-rounds N`` every point is measured N times, the systems taking
turns in alternating order (a slow stretch of the host hits every system alike); a row's step statistics are
over the pooled steps of its rounds, and ``round_p50_ms`` keeps each round's median. On CUDA, ``--profile-steps``
more steps run under the torch profiler for the device busy time (kernels + copies), so that host-bound steps show
as ``step time >> device time`` (at ``--attention-batch`` only).

The model has ``--layers`` decoder layers. Its loop cost is calibrated per batch size with DynamicCache at
``--loop-context`` on 1 and ``--layers`` layers: ``fixed`` (embedding, lm_head, sampling, generate's bookkeeping)
and a per-layer cost. A full-depth step is estimated as ``fixed + full_layers / layers * (step - fixed)``.

Calibration: each depth first runs one untimed generate (the first runs after a model is built carry one-off
costs), then ``LOOP_ROUNDS`` timed runs per depth, interleaved in alternating order (drift hits both depths
alike), each with the same ``--warmup`` steps; the step time of a depth is the median of its runs' p50s. A
calibration that does not fit ``step = fixed + layers * per_layer`` with ``per_layer > 0`` and ``fixed >= 0`` is
recorded as inconsistent and yields no full-depth estimate (``None``; the report says "n/a").

Tokens/s is ``batch / p50 step``. The stable heads' reranks are staggered over the layers (layer ``l`` at the steps
where ``(step + l) % rerank_interval == 0``), so with fewer ``--layers`` than ``--rerank-interval`` most steps hold
no rerank and the p50 (and a full-depth estimate from it) leaves them out; the report says so. With ``--layers`` >=
the interval every step holds its share (the headline runs use all 32 layers).
"""

from __future__ import annotations

import statistics
import traceback
from functools import partial
from typing import Any

from flexicache.benchmarks.measure import (
    allocated,
    cache_bytes,
    counters,
    device_busy_ms,
    fill_cache,
    peak,
    pinned_bytes,
    reset_peak,
    summarize,
    timed_generate,
)
from flexicache.benchmarks.suite import CaseResult, Suite, System, full_layers, release, systems


def decode_run(suite: Suite, model: Any, system: System, batch: int, context: int, steps: int,
               profile_steps: int = 0) -> dict[str, Any]:
    """Fill, warm up, time ``steps`` generate steps of ``model`` with ``system``'s cache at ``batch x context``."""
    s = suite.settings
    model.set_attn_implementation(system.attn_implementation)
    cache = system.make_cache(model.config, context + s.warmup + steps + profile_steps + 2, s)
    base, pinned_base = allocated(suite.device), pinned_bytes(suite.device)
    ids = fill_cache(model, cache, batch, context, s.seed)
    sequences, warm_ms = timed_generate(model, cache, ids, s.warmup)
    warm_allocated, warm_pinned = allocated(suite.device), pinned_bytes(suite.device)
    reset_peak(suite.device)
    before = counters(cache)
    sequences, step_ms = timed_generate(model, cache, sequences, steps + 1)
    step_ms = step_ms[1:]  # the first step of a generate call carries its set-up
    after = counters(cache)
    row: dict[str, Any] = {"layers": model.config.num_hidden_layers, **summarize(step_ms),
                           "warmup_max_ms": max(warm_ms[1:], default=None), "step_samples_ms": step_ms}
    row["tokens_per_s"] = 1000 * batch / row["step_ms_p50"]
    if profile_steps:
        busy = device_busy_ms(lambda: timed_generate(model, cache, sequences, profile_steps), suite.device)
        if busy is not None:  # host-bound steps leave the GPU idle most of the time
            row["device_busy_ms"] = busy / profile_steps
            row["gpu_idle_share"] = max(0.0, 1 - row["device_busy_ms"] / row["step_ms_p50"])
    row.update(cache_bytes(cache, suite.device))
    if base is not None:
        row["cache_allocated_bytes"] = warm_allocated - base
        row["decode_peak_extra_bytes"] = peak(suite.device) - warm_allocated
    if pinned_base is not None and warm_pinned is not None:
        row["pinned_host_bytes"] = warm_pinned - pinned_base
    if before:  # the timed generate ran steps + 1 forwards
        row.update({f"{key}_per_step": (after[key] - before[key]) / (steps + 1) for key in after})
    return row


LOOP_ROUNDS = 3  # timed runs per depth in a loop calibration


def calibration(step_1: float, step_l: float, layers: int, full: int) -> dict[str, Any]:
    """Fixed and per-layer loop cost from the step times on 1 and ``layers`` layers, and the ``full``-layer step.

    ``consistent`` is False, with the reason in ``inconsistency``, when the two times do not fit
    ``step = fixed + n * per_layer`` with ``per_layer > 0`` and ``fixed >= 0``; ``per_layer_ms``, ``fixed_ms``
    and ``full_depth_step_ms`` are then ``None``: an inconsistent calibration gives no estimate.
    """
    per_layer = (step_l - step_1) / (layers - 1)
    fixed = step_1 - per_layer
    if per_layer <= 0:
        reason = f"1 layer {step_1:.2f} ms >= {layers} layers {step_l:.2f} ms (per-layer cost <= 0)"
    elif fixed < 0:
        reason = f"{layers} layers {step_l:.2f} ms > {layers} x 1 layer {step_1:.2f} ms (fixed cost < 0)"
    else:
        reason = None
    consistent = reason is None
    return {"per_layer_ms": per_layer if consistent else None, "fixed_ms": fixed if consistent else None,
            "full_depth_step_ms": fixed + full * per_layer if consistent else None, "consistent": consistent,
            "inconsistency": reason}


def extrapolate(loop: dict[str, Any] | None, step_ms: float, layers: int, full: int) -> float | None:
    """Full-depth step time from a ``layers``-layer step time; ``None`` without a consistent calibration or when
    the step is shorter than the calibration's fixed cost (its per-layer part would be negative)."""
    if loop is None or not loop.get("consistent") or loop.get("fixed_ms") is None or step_ms < loop["fixed_ms"]:
        return None
    fixed = loop["fixed_ms"]
    return fixed + full / layers * (step_ms - fixed)


def loop_cost(suite: Suite, model_name: str, batch: int) -> dict[str, Any] | None:
    """The transformers loop's fixed and per-layer cost at ``batch`` (DynamicCache at ``--loop-context``), memoised;
    ``None`` when the model has a single layer. See the module docstring for the procedure."""
    s = suite.settings
    if s.layers < 2:
        return None

    def compute() -> dict[str, Any]:
        dynamic = System("dynamic")
        depths = (1, s.layers)
        models = {layers: suite.model(model_name, layers) for layers in depths}
        for layers in depths:  # untimed: the first generate after a model is built (allocator, kernels, set-up)
            decode_run(suite, models[layers], dynamic, batch, s.loop_context, 1)
        samples: dict[int, list[float]] = {layers: [] for layers in depths}
        for index in range(LOOP_ROUNDS):
            for layers in (depths if index % 2 == 0 else depths[::-1]):
                run = decode_run(suite, models[layers], dynamic, batch, s.loop_context, s.steps)
                samples[layers].append(run["step_ms_p50"])
        step = {layers: statistics.median(samples[layers]) for layers in depths}
        entry = {"model": model_name, "batch": batch, "context": s.loop_context, "step_ms_1_layer": step[1],
                 "step_ms": step[s.layers], "layers": s.layers, "full_layers": full_layers(model_name),
                 "rounds": LOOP_ROUNDS, "samples_ms_1_layer": samples[1], "samples_ms": samples[s.layers],
                 **calibration(step[1], step[s.layers], s.layers, full_layers(model_name))}
        suite.results.setdefault("loop", []).append(entry)
        print(f"[{suite.elapsed():7.1f}s] loop cost {entry}", flush=True)
        return entry

    return suite.memoised(("loop", model_name, batch), compute)


def full_depth_ms(suite: Suite, model_name: str, batch: int, step_ms: float) -> float | None:
    """Estimated step time of the full-depth model from a step time of the ``--layers`` model (``None``: no
    consistent calibration)."""
    return extrapolate(loop_cost(suite, model_name, batch), step_ms, suite.settings.layers, full_layers(model_name))


def with_full_depth(suite: Suite, model_name: str, batch: int, row: dict[str, Any]) -> dict[str, Any]:
    """``row`` plus ``full_depth``: the estimated full-depth step time and tokens/s (``None`` without a consistent
    loop calibration at ``batch``)."""
    step = full_depth_ms(suite, model_name, batch, row["step_ms_p50"])
    row["full_depth"] = None if step is None else {"step_ms_p50": step, "tokens_per_s": 1000 * batch / step}
    return row


def measurement_order(contexts: list[int], batches: list[int], context: int, batch: int, loop_context: int
                      ) -> list[tuple[int, int]]:
    """The ``(context, batch)`` grid, the headline points first (``--attention-context x --attention-batch``, then
    ``loop_context x batch``), the rest by decreasing context, so that a time budget cuts the least important
    measurements."""
    grid = [(c, b) for c in contexts for b in batches]
    return sorted(grid, key=lambda point: (point != (context, batch), point != (loop_context, batch), -point[0],
                                           point[1]))


def measure(suite: Suite, model: Any, system: System, batch: int, context: int, first_round: bool
            ) -> dict[str, Any]:
    """One round of a decode measurement (the GPU busy time in the first round only)."""
    s = suite.settings
    profiled = first_round and batch == s.attention_batch  # the profiler costs seconds per run
    return decode_run(suite, model, system, batch, context, s.steps, s.profile_steps if profiled else 0)


def merged_with_full_depth(suite: Suite, model_name: str, batch: int, rounds: list[dict[str, Any]],
                           result: CaseResult) -> dict[str, Any]:
    """The merged row of a point's rounds with its full-depth estimate; a failing loop calibration (e.g. out of
    memory) leaves the measured row without an estimate and is recorded as skipped."""
    row = merge_rounds(rounds, batch)
    try:
        return with_full_depth(suite, model_name, batch, row)
    except Exception as error:  # noqa: BLE001 - the measured rounds must not be lost with the calibration
        traceback.print_exc()
        release(suite.device)
        label = {key: row[key] for key in ("model", "system", "context", "batch")}
        result.skipped.append(dict(label, reason=f"loop calibration error: {type(error).__name__}: {error}"[:500]))
        return dict(row, full_depth=None)


def merge_rounds(rows: list[dict[str, Any]], batch: int) -> dict[str, Any]:
    """One row from the rounds of a measurement: step statistics over the pooled steps, each round's p50 in
    ``round_p50_ms``, the slowest warm-up step, and the rest (bytes, counters, GPU busy time) from the first round."""
    merged = dict(rows[0])
    samples = [ms for row in rows for ms in row["step_samples_ms"]]
    merged.update(summarize(samples), step_samples_ms=samples, rounds=len(rows),
                  round_p50_ms=[row["step_ms_p50"] for row in rows],
                  warmup_max_ms=max((row["warmup_max_ms"] for row in rows if row["warmup_max_ms"] is not None),
                                    default=None))
    merged["tokens_per_s"] = 1000 * batch / merged["step_ms_p50"]
    if "device_busy_ms" in merged:
        merged["gpu_idle_share"] = max(0.0, 1 - merged["device_busy_ms"] / merged["step_ms_p50"])
    return merged


def run(suite: Suite, model_name: str, result: CaseResult) -> None:
    s = suite.settings
    if not result.notes:
        result.notes.append(
            f"{s.layers}-layer random-weight models; `full_depth` = estimate for {full_layers(model_name)} layers "
            f"from the loop calibration (DynamicCache at {s.loop_context} tokens on 1 and {s.layers} layers; none "
            f"when the calibration is inconsistent). Step times are wall times of generate steps (device "
            f"synchronised), p50/p99 over the {s.steps} timed steps of each of up to {s.decode_rounds} rounds, pooled, "
            f"after {s.warmup} warm-up steps per round (p99 = nearest rank"
            f"{': the slowest step' if s.steps * s.decode_rounds < 100 else ''}); `round_p50_ms` keeps each round's "
            "median; `warmup_max_ms` is the slowest warm-up step "
            "(host-tier growth shows there).")
    model = suite.model(model_name)
    for context, batch in measurement_order(s.decode_contexts, s.decode_batches, s.attention_context,
                                            s.attention_batch, s.loop_context):
        measured = []
        for system in systems(s.decode_systems):
            label = {"model": model_name, "system": system.name, "context": context, "batch": batch}
            if system.kind == "dynamic-offload" and (suite.device.type != "cuda"
                                                     or batch * context > s.offload_max_tokens):
                result.skipped.append(dict(label, reason="DynamicCache(offloading=True) needs CUDA; on CUDA it "
                                           "moves all KV both ways every step: limited by --offload-max-tokens"))
                continue
            measured.append((system, label))
        rounds: dict[str, list[dict[str, Any]]] = {system.name: [] for system, _ in measured}
        for index in range(s.decode_rounds):
            for system, label in (measured if index % 2 == 0 else measured[::-1]):
                if index and (not rounds[system.name] or suite.out_of_time()):
                    continue  # its first round failed; or later rounds (extra samples) are out of time
                row = suite.attempt(result, label, partial(measure, suite, model, system, batch, context, index == 0),
                                    record=False)
                if row is not None:
                    rounds[system.name].append(row)
        for system, label in measured:
            if rounds[system.name]:
                suite.record(result, merged_with_full_depth(suite, model_name, batch, rounds[system.name], result))
