"""Measurement helpers of the model-level cases: random-weight models, cache fill, timed ``generate``, byte counts,
device time and device memory."""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoModelForCausalLM, Cache, StoppingCriteria, StoppingCriteriaList

from flexicache import FlexiCache, enable_step_graphs
from flexicache.attention import flexicache_attention_forward
from flexicache.head_split import WINDOW as TAIL_QUERIES

BYTE_KEYS = ("device_kv_bytes", "device_metadata_bytes", "device_reserved_bytes", "host_kv_bytes",
             "host_reserved_bytes", "dense_kv_bytes")
COUNTER_KEYS = ("reranks_stable", "reranks_unstable", "promoted_pages", "bytes_h2d", "bytes_d2h")


def build_model(config: Any, device: torch.device, dtype: torch.dtype, seed: int, step_graphs: bool = True) -> Any:
    """A random-weight causal LM of ``config``, built directly on ``device`` in ``dtype``, in eval mode; with
    ``step_graphs``, FlexiCache decode steps replay as whole-step CUDA graphs (other caches are unaffected)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    if step_graphs:
        enable_step_graphs(model)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def weight_bytes(model: Any, full_layers: int) -> tuple[int, int]:
    """``(bytes of this model's weights, bytes of the same model with full_layers decoder layers)``."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    layers = model.model.layers
    per_layer = sum(p.numel() * p.element_size() for p in layers[0].parameters())
    return total, total + (full_layers - len(layers)) * per_layer


def random_ids(batch: int, length: int, vocab_size: int, device: torch.device, seed: int) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(1, vocab_size, (batch, length), generator=generator, device=device)


FILL_CHUNK_BYTES = 2**30  # random keys + values that :func:`fill_cache` writes per chunk (32k x batch 8 of an 8B model)


@torch.no_grad()
def fill_cache(model: Any, cache: Cache, batch: int, context: int, seed: int) -> torch.Tensor:
    """Put ``context`` random keys/values per request into ``cache`` layer by layer, as a prefill would, without
    running the model (a batched long prefill would not fit): in one chunk, or where that chunk's keys and values
    would pass :data:`FILL_CHUNK_BYTES` as a chunked prefill would (chunks through every layer in turn; small
    random tensors beside a nearly full device). Returns input ids ``[batch, context + 1]`` whose last token is the
    first one ``generate`` decodes."""
    config, device, dtype = model.config, model.device, model.dtype
    generator = torch.Generator(device=device).manual_seed(seed)
    token_bytes = 2 * batch * config.num_key_value_heads * config.head_dim * dtype.itemsize
    chunk = max(1, FILL_CHUNK_BYTES // token_bytes)
    for start in range(0, context, chunk):
        length = min(chunk, context - start)
        kv_shape = (batch, config.num_key_value_heads, length, config.head_dim)
        positions = torch.arange(start, start + length, device=device)
        for index, layer in enumerate(model.model.layers):
            keys = torch.randn(kv_shape, generator=generator, device=device, dtype=dtype)
            values = torch.randn(kv_shape, generator=generator, device=device, dtype=dtype)
            # the positions are for StaticCache (older transformers read them from the cache kwargs, newer count)
            cache.update(keys, values, index, {"cache_position": positions})
            if isinstance(cache, FlexiCache):
                # The staged chunk holds the keys; committing it (and the stable heads' first selection, and the
                # head split of a cache without a profile) needs a forward: random queries of the chunk's last
                # TAIL_QUERIES positions, whose (unused) dense output is computed over those positions only.
                tail = min(TAIL_QUERIES, length)
                query = torch.randn(batch, config.num_attention_heads, tail, config.head_dim, generator=generator,
                                    device=device, dtype=dtype)
                flexicache_attention_forward(layer.self_attn, query, keys[:, :, -tail:], values[:, :, -tail:],
                                             None, scaling=layer.self_attn.scaling)
            del keys, values
    return random_ids(batch, context + 1, config.vocab_size, device, seed)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock(StoppingCriteria):
    """Wall-clock time after every generated token (the device synchronised first); never stops generation."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times = [time.perf_counter()]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        synchronize(self.device)
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def step_ms(self) -> list[float]:
        return [1000 * (end - start) for start, end in zip(self.times, self.times[1:])]


def timed_generate(model: Any, cache: Cache, ids: torch.Tensor, new_tokens: int,
                   attention_mask: torch.Tensor | None = None, prefill_chunk: int = 0
                   ) -> tuple[torch.Tensor, list[float]]:
    """Greedy ``generate`` of ``new_tokens`` tokens with ``past_key_values=cache``: ``(sequences, ms per step)``.

    The first step includes ``generate``'s set-up (and the prefill when the cache holds less than ``ids``);
    ``prefill_chunk`` > 0 prefills in chunks of that many tokens (``prefill_chunk_size``).
    """
    clock = StepClock(ids.device)
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask
    chunking = {"prefill_chunk_size": prefill_chunk} if prefill_chunk else {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
        sequences = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens,
                                   do_sample=False, stopping_criteria=StoppingCriteriaList([clock]), **chunking)
    return sequences, clock.step_ms()


def nearest_rank_p99(ordered: list[float]) -> float:
    """The 99th percentile of ascending ``ordered`` by the nearest rank: the slowest but ``len(ordered) // 100``."""
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def summarize(step_ms: list[float]) -> dict[str, float]:
    """p50 (median), p99 (nearest rank), mean and p99/p50 of step times."""
    ordered = sorted(step_ms)
    p50 = statistics.median(ordered)
    p99 = nearest_rank_p99(ordered)
    return {"step_ms_p50": p50, "step_ms_p99": p99, "step_ms_mean": statistics.fmean(ordered),
            "p99_over_p50": p99 / p50}


def device_kernels(run: Callable[[], Any], device: torch.device) -> dict[str, tuple[float, int]] | None:
    """``{name: (summed ms, launches)}`` of the GPU kernels and copies issued by ``run()`` (torch profiler); ``None``
    on CPU."""
    if device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        synchronize(device)
    kernels: dict[str, tuple[float, int]] = {}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            ms, launches = kernels.get(event.name, (0.0, 0))
            kernels[event.name] = (ms + event.time_range.elapsed_us() / 1000, launches + 1)
    return kernels


def device_busy_ms(run: Callable[[], Any], device: torch.device) -> float | None:
    """Summed duration of the GPU kernels and copies issued by ``run()`` (:func:`device_kernels`), ms; ``None`` on
    CPU."""
    kernels = device_kernels(run, device)
    return None if kernels is None else sum(ms for ms, _ in kernels.values())


def allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def pinned_bytes(device: torch.device) -> int | None:
    """Bytes of pinned host blocks handed out by torch's host allocator (its rounding included); CUDA only."""
    if device.type != "cuda":
        return None
    return torch.cuda.host_memory_stats().get("active_bytes.current")


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def cache_bytes(cache: Cache, device: torch.device) -> dict[str, int]:
    """Device/host bytes of any of the benchmarked caches, under :class:`FlexiCache.stats`'s names.

    For a DynamicCache, device KV = reserved = its tensors on ``device``; host = its tensors elsewhere (offloaded).
    """
    if isinstance(cache, FlexiCache):
        stats = cache.stats()
        return {key: int(stats[key]) for key in BYTE_KEYS}
    on_device = on_host = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if tensor is None:
                continue
            if tensor.device.type == device.type:
                on_device += tensor.nbytes
            else:
                on_host += tensor.nbytes
    return {"device_kv_bytes": on_device, "device_metadata_bytes": 0, "device_reserved_bytes": on_device,
            "host_kv_bytes": on_host, "host_reserved_bytes": on_host, "dense_kv_bytes": on_device + on_host}


def counters(cache: Cache) -> dict[str, int]:
    """FlexiCache's rerank and transfer counters (empty for other caches)."""
    if not isinstance(cache, FlexiCache):
        return {}
    stats = cache.stats()
    return {key: int(stats[key]) for key in COUNTER_KEYS}
