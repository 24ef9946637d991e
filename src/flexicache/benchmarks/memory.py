"""Memory case: device KV bytes and peak device memory vs context length, per system (``--memory-batch``, 1 by
default; ``--prefill-chunk`` prefills in chunks, as ``generate(prefill_chunk_size=...)`` does).

Each measurement runs a real ``generate``: the prefill of random prompts of ``context`` tokens, then
``--memory-steps`` decode steps (enough to open new pages and grow FlexiCache's pools). Bytes come from the cache
(``FlexiCache.stats()`` names); on CUDA the allocator's peak during generate is recorded too. ``full_depth``
scales everything per layer to the full model: KV bytes exactly, the peak as
``weights(full) + peak over the weights + (full_layers / layers - 1) * cache bytes left allocated`` (an estimate).
``DynamicCache(offloading=True)`` is the exception: it keeps one (prefetched) layer on the device at any depth, so
its device bytes are not scaled and the other layers' KV is on the host (``offload_full_depth``).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from flexicache.benchmarks.measure import (
    allocated,
    cache_bytes,
    peak,
    random_ids,
    reset_peak,
    timed_generate,
    weight_bytes,
)
from flexicache.benchmarks.suite import CaseResult, Suite, System, full_layers, systems


def measure(suite: Suite, model: Any, system: System, context: int, full: int) -> dict[str, Any]:
    s = suite.settings
    model.set_attn_implementation(system.attn_implementation)
    cache = system.make_cache(model.config, context + s.memory_steps + 1, s)
    ids = random_ids(s.memory_batch, context, model.config.vocab_size, suite.device, s.seed)
    reset_peak(suite.device)
    base = allocated(suite.device)
    _, step_ms = timed_generate(model, cache, ids, s.memory_steps, prefill_chunk=s.prefill_chunk)
    row: dict[str, Any] = {"layers": s.layers, "prefill_chunk": s.prefill_chunk, "prefill_ms": step_ms[0],
                           **cache_bytes(cache, suite.device)}
    on_device = row["device_kv_bytes"] + row["device_metadata_bytes"]
    row["device_fraction_of_dense"] = on_device / row["dense_kv_bytes"]
    scale = full / s.layers
    row["full_depth"] = {"layers": full, "device_kv_bytes": row["device_kv_bytes"] * scale,
                         "device_bytes": on_device * scale,
                         "device_reserved_bytes": row["device_reserved_bytes"] * scale,
                         "host_reserved_bytes": row["host_reserved_bytes"] * scale}
    if base is not None:  # CUDA: the allocator's view (``base`` holds the weights and nothing of this cache)
        left = allocated(suite.device) - base
        row.update(cache_allocated_bytes=left, peak_bytes=peak(suite.device), peak_over_base_bytes=peak(suite.device)
                   - base, weights_full_bytes=weight_bytes(model, full)[1])
        row["full_depth"]["peak_bytes"] = row["weights_full_bytes"] + row["peak_over_base_bytes"] + (scale - 1) * left
    if system.kind == "dynamic-offload":
        row["full_depth"] = offload_full_depth(row)
    return row


def offload_full_depth(row: dict[str, Any]) -> dict[str, Any]:
    """Full-depth bytes of a ``DynamicCache(offloading=True)`` row: the device keeps what it kept on ``layers``
    layers (one prefetched layer), the host holds the rest of the full-depth KV; the peak does not grow with depth.
    Works on rows of any ``bench.json`` (the per-layer scaling of older runs is undone)."""
    full = dict(row["full_depth"])
    scale = full["layers"] / row["layers"]
    device = row["device_kv_bytes"] + row["device_metadata_bytes"]
    full.update(device_kv_bytes=row["device_kv_bytes"], device_bytes=device,
                device_reserved_bytes=row["device_reserved_bytes"],
                host_reserved_bytes=row["dense_kv_bytes"] * scale - row["device_kv_bytes"],
                device_resident_layers=round(row["layers"] * row["device_kv_bytes"] / row["dense_kv_bytes"]),
                offloading=True)
    if "cache_allocated_bytes" in row and "peak_bytes" in full and not row["full_depth"].get("offloading"):
        full["peak_bytes"] = full["peak_bytes"] - (scale - 1) * row["cache_allocated_bytes"]
    return full


def prefill_text(prefill_chunk: int) -> str:
    return f"chunks of {prefill_chunk} tokens" if prefill_chunk else "one forward"


def run(suite: Suite, model_name: str, result: CaseResult) -> None:
    s = suite.settings
    full = full_layers(model_name)
    if not result.notes:
        result.notes.append(
            f"Batch {s.memory_batch}, real prefill ({prefill_text(s.prefill_chunk)}) + {s.memory_steps} decode steps "
            f"on a {s.layers}-layer model; `full_depth` scales "
            f"to {full} layers (KV exactly, peak as an estimate). Device bytes of FlexiCache = pages in use "
            "(`device_kv_bytes`) + page min/max (`device_metadata_bytes`); `device_reserved_bytes` includes pool "
            "capacity not yet used.")
    model = suite.model(model_name)
    for context in s.memory_contexts:
        for system in systems(s.memory_systems):
            label = {"model": model_name, "system": system.name, "context": context, "batch": s.memory_batch}
            if system.kind == "dynamic-offload" and suite.device.type != "cuda":
                result.skipped.append(dict(label, reason="DynamicCache(offloading=True) needs CUDA"))
                continue
            suite.attempt(result, label, partial(measure, suite, model, system, context, full))
