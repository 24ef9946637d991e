"""Throughput cases: the largest batch that fits at ``--throughput-context`` and tokens/s there; an offline mix of
L-Eval-like requests (requests/s).

Largest batch (full-depth model, an estimate from measured bytes): a probe at ``--probe-batch`` gives each system's
device and host bytes per sequence and layer (after warm-up, pool growth included) and its decode transient (CUDA
peak over the steady state). The batch is the largest with
``weights(full) + reserve + batch * (per_layer * full_layers + transient) <= device memory`` and
``batch * host_per_layer * full_layers <= host memory``. Tokens/s there are measured on the ``--layers`` model at
that batch (a few smaller batches tried where it runs out of device memory) and extrapolated to full depth with the
loop calibration (see :mod:`flexicache.benchmarks.decode`).

Offline mix: ``--mix-requests`` requests, inputs uniform in ``--mix-input``, outputs log-uniform in ``--mix-output``,
sorted by input length and served in static batches of ``--mix-batch`` with ``generate`` (left padding, real
prefill; a batch decodes until its longest output). At most ``--mix-max-steps`` decode steps per batch are run; the
rest are counted at the batch's measured median step time (the report says how many were measured).
"""

from __future__ import annotations

import math
import os
import random
import statistics
from functools import partial
from typing import Any

import torch

from flexicache.benchmarks.decode import decode_run, full_depth_ms, with_full_depth
from flexicache.benchmarks.measure import random_ids, timed_generate, weight_bytes
from flexicache.benchmarks.results import size
from flexicache.benchmarks.suite import GIB, CaseResult, Suite, System, full_layers, release, systems


def memory_limits(suite: Suite) -> tuple[float, float]:
    """``(device bytes, host bytes)`` a full-depth model may use: the settings, else the GPU's total memory and
    85% of the host's RAM (the rest for the process, the OS and the pinned tier's growth copies)."""
    s = suite.settings
    if s.device_memory_gib:
        device = s.device_memory_gib * GIB
    else:
        device = torch.cuda.get_device_properties(suite.device).total_memory
    host = s.host_memory_gib * GIB if s.host_memory_gib else 0.85 * os.sysconf("SC_PAGE_SIZE") * os.sysconf(
        "SC_PHYS_PAGES")
    return device, host


def largest_batch(suite: Suite, model_name: str, system: System) -> dict[str, Any]:
    """Capacity model of ``system`` at ``--throughput-context`` from a probe at ``--probe-batch``."""
    s = suite.settings
    model = suite.model(model_name)
    full = full_layers(model_name)
    probe_batch = s.probe_batch
    probe = decode_run(suite, model, system, probe_batch, s.throughput_context, 2)
    per_layer_device = probe["device_reserved_bytes"] / (probe_batch * s.layers)  # pools, metadata, capacity
    # The cache's host bytes as it counts them, or torch's pinned blocks holding them where those are larger (its
    # allocator rounds up, e.g. DynamicCache's offloading; FlexiCache's registered tier is not among them)
    host = max(probe["host_reserved_bytes"], probe.get("pinned_host_bytes") or 0)
    per_layer_host = host / (probe_batch * s.layers)
    transient = (probe.get("decode_peak_extra_bytes") or 0) / probe_batch
    device_limit, host_limit = memory_limits(suite)
    weights_full = weight_bytes(model, full)[1]
    per_sequence = per_layer_device * full + transient
    by_device = math.floor((device_limit - weights_full - s.reserve_gib * GIB) / per_sequence)
    by_host = math.floor(host_limit / (per_layer_host * full)) if per_layer_host else None
    bounds = {"device": by_device, "max_batch": s.max_batch}
    if by_host is not None:
        bounds["host"] = by_host
    bound = min(bounds, key=bounds.get)
    return {"largest_batch": max(0, bounds[bound]), "bound": bound, "batch_by_device": by_device,
            "batch_by_host": by_host, "device_bytes_per_sequence_full": per_sequence,
            "host_bytes_per_sequence_full": per_layer_host * full, "weights_full_bytes": weights_full,
            "device_limit_bytes": device_limit, "host_limit_bytes": host_limit, "probe_batch": probe_batch,
            "probe_allocated_bytes": probe.get("cache_allocated_bytes"),
            "probe_host_reserved_bytes": probe["host_reserved_bytes"], "probe_host_kv_bytes": probe["host_kv_bytes"],
            "probe_pinned_host_bytes": probe.get("pinned_host_bytes")}


OOM_RETRIES = 4  # smaller batches tried after the estimated largest batch ran out of device memory
OOM_STEP = 0.95  # each retry's batch: this share of the last one (at least one less)


def measure_throughput(suite: Suite, model_name: str, system: System) -> dict[str, Any]:
    """Tokens/s at the estimated largest batch; where that runs out of device memory (a transient the probe did
    not see: allocator fragmentation, a kernel's workspace), at the largest of up to :data:`OOM_RETRIES` smaller
    batches that runs (``largest_batch`` is then the batch that ran, ``estimated_batch`` the estimate and
    ``out_of_memory_at`` the batches that did not fit)."""
    s = suite.settings
    row = largest_batch(suite, model_name, system)
    batch = row["largest_batch"]
    row["estimated_batch"], row["out_of_memory_at"] = batch, []
    run = None
    while batch >= 1 and run is None:
        try:
            run = decode_run(suite, suite.model(model_name), system, batch, s.throughput_context, s.steps,
                             s.profile_steps)
        except torch.OutOfMemoryError:
            if len(row["out_of_memory_at"]) == OOM_RETRIES:
                raise
        if run is None:  # out of the except clause: the failed attempt's frames (and its cache) are gone
            release(suite.device)
            row["out_of_memory_at"].append(batch)
            batch = min(batch - 1, math.floor(batch * OOM_STEP))
    if run is None and not row["out_of_memory_at"]:  # an estimate of 0: not even one sequence fits
        return row
    if run is None:  # every batch down to 1 ran out of memory before the retries were used up
        raise torch.OutOfMemoryError(f"{system.name}: even a batch of 1 at {s.throughput_context} tokens ran out of "
                                     f"device memory (tried {row['out_of_memory_at']}); lower --throughput-context")
    row["largest_batch"] = batch
    keep = ("step_ms_p50", "step_ms_p99", "p99_over_p50", "tokens_per_s", "device_busy_ms", "gpu_idle_share", "layers",
            "device_reserved_bytes", "host_reserved_bytes")
    row.update({key: run[key] for key in keep if key in run})
    return with_full_depth(suite, model_name, batch, row)


def run(suite: Suite, model_name: str, result: CaseResult) -> None:
    s = suite.settings
    if not result.notes:
        result.notes.append(
            f"Largest batch at {s.throughput_context} tokens for the full-depth model ({full_layers(model_name)} "
            f"layers), estimated from bytes measured at batch {s.probe_batch} on {s.layers} layers; tokens/s "
            f"measured at that batch on {s.layers} layers (where it runs out of device memory, at the largest of "
            f"{OOM_RETRIES} smaller batches that runs), `full_depth` extrapolated (none when the loop calibration "
            f"at that batch is inconsistent). Limits: device "
            f"{size(memory_limits(suite)[0])} minus {size(s.reserve_gib * GIB)} reserve, host "
            f"{size(memory_limits(suite)[1])}.")
    for system in systems(s.throughput_systems):
        label = {"model": model_name, "system": system.name, "context": s.throughput_context}
        if system.kind == "dynamic-offload":  # one layer resident at any depth: the per-layer scaling does not apply
            result.skipped.append(dict(label, reason="the capacity model scales bytes per layer, which "
                                                     "DynamicCache(offloading=True) does not take"))
            continue
        suite.attempt(result, label, partial(measure_throughput, suite, model_name, system))


# --------------------------------------------------------------------------------------------------- offline mix


def mix_requests(count: int, inputs: list[int], outputs: list[int], seed: int) -> list[tuple[int, int]]:
    """``count`` ``(input, output)`` lengths: inputs uniform, outputs log-uniform in their ``[low, high]``."""
    rng = random.Random(seed)
    return [(rng.randint(inputs[0], inputs[1]),
             round(math.exp(rng.uniform(math.log(outputs[0]), math.log(outputs[1]))))) for _ in range(count)]


def left_padded(lengths: list[int], vocab_size: int, device: torch.device, seed: int) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """Random prompts of ``lengths``, left-padded with id 0: ``(input_ids, attention_mask)``."""
    width = max(lengths)
    ids = random_ids(len(lengths), width, vocab_size, device, seed)
    positions = torch.arange(width, device=device)
    mask = positions.unsqueeze(0) >= torch.tensor([width - n for n in lengths], device=device).unsqueeze(1)
    return ids.masked_fill(~mask, 0), mask.long()


def measure_mix(suite: Suite, model_name: str, system: System, requests: list[tuple[int, int]]) -> dict[str, Any]:
    s = suite.settings
    model = suite.model(model_name)
    scale = full_layers(model_name) / s.layers
    ordered = sorted(requests)
    prefill_ms = decode_ms = prefill_full_ms = decode_full_ms = 0.0
    steps_total = steps_measured = 0
    loop_batches = []
    for start in range(0, len(ordered), s.mix_batch):
        batch = ordered[start:start + s.mix_batch]
        lengths, steps = [n for n, _ in batch], max(out for _, out in batch)
        ids, mask = left_padded(lengths, model.config.vocab_size, suite.device, s.seed + start)
        model.set_attn_implementation(system.attn_implementation)  # the loop calibration may have switched it
        cache = system.make_cache(model.config, ids.shape[1] + steps + 1, s)
        run_steps = min(steps, s.mix_max_steps + 1)
        _, step_ms = timed_generate(model, cache, ids, run_steps, mask)
        del cache
        median = statistics.median(step_ms[1:]) if len(step_ms) > 1 else step_ms[0]
        batch_decode = sum(step_ms[1:]) + (steps - run_steps) * median
        prefill_ms += step_ms[0]
        decode_ms += batch_decode
        prefill_full_ms += step_ms[0] * scale
        full_step = full_depth_ms(suite, model_name, len(batch), median)
        loop_batches.append(len(batch))
        decode_full_ms += math.nan if full_step is None else (steps - 1) * full_step
        steps_total += steps - 1
        steps_measured += run_steps - 1
    total_s = (prefill_ms + decode_ms) / 1000
    full_s = (prefill_full_ms + decode_full_ms) / 1000
    outputs = sum(out for _, out in requests)
    row = {"layers": s.layers, "requests": len(requests), "batch": s.mix_batch, "prefill_s": prefill_ms / 1000,
           "decode_s": decode_ms / 1000, "decode_steps": steps_total, "decode_steps_measured": steps_measured,
           "total_s": total_s, "requests_per_s": len(requests) / total_s, "output_tokens_per_s": outputs / total_s,
           "loop_batches": sorted(set(loop_batches))}
    if not math.isnan(full_s):
        row["full_depth"] = {"total_s": full_s, "requests_per_s": len(requests) / full_s,
                             "output_tokens_per_s": outputs / full_s}
    return row


def run_mix(suite: Suite, model_name: str, result: CaseResult) -> None:
    s = suite.settings
    requests = mix_requests(s.mix_requests, s.mix_input, s.mix_output, s.seed)
    if not result.notes:
        result.notes.append(
            f"{len(requests)} requests, inputs {s.mix_input[0]}-{s.mix_input[1]} tokens, outputs "
            f"{s.mix_output[0]}-{s.mix_output[1]} (log-uniform), static batches of {s.mix_batch} sorted by input, "
            f"real prefill; at most {s.mix_max_steps} decode steps per batch measured, the rest counted at the "
            "batch's median step. "
            + (f"`full_depth`: prefill x {full_layers(model_name)}/{s.layers}, steps extrapolated with the loop "
               "calibration (none when it is inconsistent). " if s.layers < full_layers(model_name) else "")
            + f"Lengths: {requests}")
    for system in systems(s.mix_systems):
        label = {"model": model_name, "system": system.name}
        suite.attempt(result, label, partial(measure_mix, suite, model_name, system, requests))
