"""What a FlexiCache checks before each forward (at its first paged layer's ``update``), before anything changes.

- **State after an error.** An exception inside a forward (in a layer's decode, or in a graphed step's recording)
  leaves some layers one chunk ahead of the others, or host bookkeeping ahead of the device work. Decoding on from
  there would attend over the wrong tokens silently: the next forward raises instead, saying to ``reset()``. So
  does a first forward that ended with prompt chunks still parked for the online head split (nothing stored).
- **One thread per shared backend** (:mod:`flexicache.thread_claims`).
- **Host memory before it is taken.** When this forward's tokens will grow the host tiers (or make them), the bytes
  all layers' tiers need together are compared with what the process can still take
  (:mod:`flexicache.host_limits`, and the pinned pool's limit on CUDA): a cache that cannot fit fails at its first
  layer with the number of GiB it needs, not after locking most of them, and not in the OOM killer.
- **The fast path.** At the first decode step on one GPU from a forward that never replays whole steps as CUDA
  graphs, the calling model's forward is wrapped so that the later steps do (:func:`adopt_unwrapped_forward`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from flexicache import host_tier, thread_claims
from flexicache.backends import DecodeBackend, PreparedBackend
from flexicache.config import FlexiCacheConfig
from flexicache.head_split import OnlineHeadSplit, too_few_to_split, unstable_count
from flexicache.host_limits import check_room, gib, system_limits
from flexicache.host_pool import REMEDY, block_size, host_pool
from flexicache.sequence import SequenceState
from flexicache.step_graph import (LAYER_BY_LAYER, StepGraphs, StepGraphStore, calling_model, enable_step_graphs,
                                   single_cuda_device)
from flexicache.storage import LayerStorage
from flexicache.warn_once import warn_once

INTERRUPTED = ("A previous forward through this FlexiCache stopped part-way ({where}), so its layers no longer hold "
               "the same tokens; decoding on would attend over the wrong ones. Call cache.reset() and generate again "
               "from the prompt (or build a new FlexiCache).")


class PagedLayer(Protocol):
    layer_idx: int
    num_chunks: int
    stable_heads: list[int]
    settings: FlexiCacheConfig
    storage: LayerStorage | None
    awaits_head_split: bool
    profile_unstable: list[int]  # the default profile's unstable heads, the online split's floor


def begin_forward(cache: thread_claims.Claimant, layers: Sequence[PagedLayer], sequence: SequenceState,
                  failure: str | None, head_split: OnlineHeadSplit | None, backends: dict[torch.device, DecodeBackend],
                  key_states: torch.Tensor) -> None:
    """All the checks of the module docstring, for a forward whose first layer receives ``key_states [B, H, T, D]``.

    Args:
        failure: what went wrong in the cache's last graphed step, if anything did (``StepGraphStore.failed``).
        head_split: the cache's online head split (``None``: it has a profile).

    Raises:
        RuntimeError: the cache's state is incomplete after an error, or another thread holds its backend.
        HostMemoryError: the host tiers would not fit.
    """
    check_in_step(layers, sequence, failure)
    if head_split is not None and head_split.interrupted:  # the prompt was not stored
        parked = head_split.abandon()
        raise RuntimeError(INTERRUPTED.format(
            where=f"layers {parked} parked their first prompt chunk for the head split, which the last of the "
                  f"cache's {head_split.num_layers} paged layers decides and stores")
            + deeper_cache_hint(layers, parked))
    shared = {device: backend for device, backend in backends.items() if isinstance(backend, PreparedBackend)}
    if shared:
        thread_claims.claim(cache, shared.values(), ", ".join(str(device) for device in shared))
    check_host_demand(layers, sequence, key_states)


def refuse_use_cache_off(attention_kwargs: object) -> None:
    """Raise for a forward with ``use_cache=False`` (transformers >= 5.24 passes the attention's keyword arguments,
    ``attention_kwargs``, to ``update``; older releases do not, and are not checked)."""
    if isinstance(attention_kwargs, dict) and attention_kwargs.get("use_cache") is False:
        raise ValueError(
            "use_cache=False with a FlexiCache: transformers then feeds the whole sequence into the cache again at "
            "every step (with any cache, DynamicCache too), which no cache can serve. Leave use_cache on, or pass "
            "no cache."
        )


def check_in_step(layers: Sequence[PagedLayer], sequence: SequenceState, failure: str | None) -> None:
    """Raise if a forward stopped part-way: layers at different chunk counts, or a failed graphed step."""
    if failure is not None:
        raise RuntimeError(INTERRUPTED.format(where=f"a decode step run as a CUDA graph failed: {failure}"))
    behind = [layer.layer_idx for layer in layers if layer.num_chunks != sequence.num_chunks]
    if behind:
        reached = [layer.layer_idx for layer in layers if layer.num_chunks > 0]
        raise RuntimeError(INTERRUPTED.format(where=f"layers {behind} did not store the last chunk")
                           + deeper_cache_hint(layers, reached))


def deeper_cache_hint(layers: Sequence[PagedLayer], reached: list[int]) -> str:
    """The likelier cause when a first forward reached only the first of the cache's paged layers (``reached``, layer
    indices): a model shallower than the config the cache was built from (its forward raised nothing)."""
    indices = [layer.layer_idx for layer in layers]
    if not reached or reached != indices[:len(reached)] or len(reached) == len(indices):
        return ""
    return (f" If this model's last layer is layer {reached[-1]}, the cache was built for a deeper model (its paged "
            f"layers run to layer {indices[-1]}): build it from this model's config, e.g. "
            f"FlexiCache.from_model(model).")


def check_host_demand(layers: Sequence[PagedLayer], sequence: SequenceState, key_states: torch.Tensor) -> None:
    """Raise :class:`~flexicache.host_limits.HostMemoryError` if the host tiers of ``layers`` cannot grow (or be made)
    to hold this chunk's tokens (``key_states [B, H, T, D]``: real tokens at most ``T`` more per request)."""
    stable = [layer for layer in layers if layer.stable_heads]
    if not stable:
        return
    settings = stable[0].settings
    longest = 0 if sequence.num_tokens_host is None else int(sequence.num_tokens_host.max())
    pages = -(-(longest + key_states.shape[2]) // settings.page_size)
    if all(tier_pages(layer.storage, settings, pages) is None for layer in stable):
        return  # every tier has room (a decode step, most of the time)
    batch_size, _, _, head_dim = key_states.shape
    host_dtype = settings.host_tier_dtype(key_states.dtype)
    page_bytes = 2 * settings.page_size * head_dim * host_dtype.itemsize  # K + V
    device = key_states.device if layers[0].storage is None else layers[0].storage.device
    pinned = host_tier.pins_host_tier(device)
    needed, largest_replaced, heads = 0, 0, 0.0
    for layer, stable_heads in zip(stable, planned_stable_heads(stable), strict=True):
        head_pages = tier_pages(layer.storage, settings, pages)
        if head_pages is None:
            continue
        current = 0 if layer.storage is None else layer.storage.offloaded.host.k.shape[2]
        new_bytes = math.ceil(head_pages * stable_heads * batch_size * page_bytes)
        old_bytes = current * len(layer.stable_heads) * batch_size * page_bytes
        if pinned:  # the pool hands out whole blocks
            new_bytes, old_bytes = block_size(new_bytes), block_size(old_bytes)
        needed += new_bytes - old_bytes
        largest_replaced = max(largest_replaced, old_bytes)  # a growing tier's old and new buffers coexist briefly
        heads += stable_heads
    what = (f"the {'page-locked ' if pinned else ''}host tiers of this cache's stable heads ({round(heads)} KV heads x "
            f"batch {batch_size} x {pages * settings.page_size} tokens at {page_bytes // settings.page_size} bytes per "
            f"token and head; {gib(needed)} for the tiers, the rest while a tier grows)")
    limits = host_pool().limits() if pinned else system_limits()
    check_room(needed + largest_replaced, limits, what, REMEDY)


def planned_stable_heads(layers: Sequence[PagedLayer]) -> list[float]:
    """Each layer's stable heads at its next store. A layer waiting for the online head split
    (:mod:`flexicache.head_split`) holds every head as stable until the split makes
    :func:`~flexicache.head_split.unstable_count` of all waiting heads unstable (all of them where
    :func:`~flexicache.head_split.too_few_to_split`): it counts its share of the rest."""
    waiting = [layer for layer in layers if layer.awaits_head_split]
    heads = sum(len(layer.stable_heads) for layer in waiting)
    kept = 1.0
    if heads:
        fraction = waiting[0].settings.unstable_fraction
        unstable = heads if too_few_to_split(heads) else unstable_count(
            heads, sum(len(layer.profile_unstable) for layer in waiting), fraction)
        kept = 1 - unstable / heads
    return [len(layer.stable_heads) * (kept if layer.awaits_head_split else 1.0) for layer in layers]


def tier_pages(storage: LayerStorage | None, settings: FlexiCacheConfig, pages: int) -> int | None:
    """Pages per row the host tier of ``storage`` (``None``: not made yet) will have once it holds ``pages`` pages
    (:func:`~flexicache.host_tier.grown_capacity`), or ``None`` if it has room already."""
    current = settings.reserved_pages if storage is None else storage.offloaded.host.k.shape[2]
    if pages <= current:
        return None if storage is not None else current
    return host_tier.grown_capacity(pages)


UNWRAPPED_HINT = (
    "FlexiCache: this cache decodes layer by layer, because the model's forward does not replay whole decode steps "
    "as CUDA graphs and no transformers model was found calling it: on a GPU transformers' decode loop is then bound "
    "by the host, several times slower than whole-step graphs at long contexts. Build the cache with "
    "FlexiCache.from_model(model, ...), or call flexicache.enable_step_graphs(model) once; cuda_graphs=False in the "
    "cache's settings silences this."
)


def adopt_unwrapped_forward(store: StepGraphStore, keys: torch.Tensor) -> None:
    """At the first decode step (``keys [B, H, 1, D]``) of a cache that could replay whole-step graphs
    (``cuda_graphs`` on, all layers on one CUDA device, no refusal) but runs from a forward that
    :func:`~flexicache.step_graph.enable_step_graphs` never wrapped (the plain ``FlexiCache(config)`` path): wrap the
    forward of the model calling it, so that its later decode steps replay as whole-step graphs (this one runs layer
    by layer). A model that :func:`~flexicache.step_graph.disable_step_graphs` set to layer by layer stays so; where
    no model is found, warn once per process with what to call."""
    if (store.driven or store.unwrapped_seen or not store.enabled or store.refusal is not None
            or keys.shape[2] != 1 or keys.device.type != "cuda" or not store.layers
            or not all(layer.is_initialized for layer in store.layers) or not single_cuda_device(store.layers)):
        return
    store.unwrapped_seen = True
    model = calling_model()
    if model is not None and getattr(model, LAYER_BY_LAYER, False):
        return
    if model is None or isinstance(model.forward, StepGraphs):
        warn_once(UNWRAPPED_HINT, RuntimeWarning, stacklevel=4)
        return
    enable_step_graphs(model)
