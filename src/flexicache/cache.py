"""``FlexiCache``: a transformers cache with sparse per-head top-K page attention at decode.

Each full-attention decoder layer is a :class:`~flexicache.layer.FlexiLayer` holding its KV heads in two classes
(from a :class:`HeadProfile`): unstable heads keep every page on the device and rerank every decode step; stable
heads keep only a working set of pages plus the tail page on the device (attending at each step to its best
``K - 1``), the full KV in a host tier, and rerank every ``rerank_interval`` steps. In a model that mixes layer
types, its sliding-window and chunked layers are :class:`~flexicache.sliding.SlidingWindowLayer` objects that keep
exactly their window (:mod:`flexicache.hybrid` says which layer is which). The cache holds what its layers share (the
per-request bookkeeping, the decode backend per device, the whole-step graphs) and the operations on the whole batch
(reset, crop, selecting and repeating requests, stats).

A cache nobody refers to is freed by reference counting alone, its host tier and device buffers with it;
:meth:`FlexiCache.close` (or a ``with`` block) frees them at once.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import Cache

from flexicache import attention, forward_guard, handoff
from flexicache.backends import DecodeBackend, require_flashinfer_support
from flexicache.config import DEFAULT_UNSTABLE_FRACTION, FlexiCacheConfig, integer_argument
from flexicache.decode_graph import StepInputs
from flexicache.head_split import OnlineHeadSplit
from flexicache.host_pool import host_pool
from flexicache.hybrid import LayerKind, check_supported_model, layer_kinds
from flexicache.layer import CLOSED_MESSAGE, FlexiLayer
from flexicache.parallel import local_view
from flexicache.profile import HeadProfile, is_online_profile, model_shape, resolve_profile
from flexicache.sequence import SequenceState
from flexicache.sliding import SlidingWindowLayer
from flexicache.step_graph import HYBRID_REFUSAL, StepGraphStore, SupportsStepGraphs, enable_step_graphs
from flexicache.storage_ops import crop_storage, select_requests

NO_SPARSE_LAYERS_WARNING = (
    "This model has no full-attention layer (all {count} are sliding-window or chunked, windows {windows}): "
    "FlexiCache keeps their windows as DynamicCache does and saves nothing. Use DynamicCache for it; or, if prompt + "
    "new tokens stay within the window (where a sliding window sees every token), set config.sliding_window = None "
    "and FlexiCache pages every layer with the same outputs."
)


class FlexiCache(DynamicCache, SupportsStepGraphs):
    """Sparse top-K page KV cache with a host tier for temporally stable heads.

    Example::

        with FlexiCache.from_model(model, token_budget=1024) as cache:
            out = model.generate(**inputs, past_key_values=cache, max_new_tokens=256)
            cache.stats()

    Args:
        config: the model's config (shape, layer types).
        profile: a :class:`HeadProfile`, a path to one, a shipped profile's name or a hub repository id (as
            :meth:`HeadProfile.from_pretrained` takes); ``None`` (or ``"online"``): the unstable heads
            (``unstable_fraction`` of all) estimated from the prompt at the first prefill
            (:mod:`flexicache.head_split`); ``"default"``: :meth:`HeadProfile.default`.
        token_budget, page_size, rerank_interval, rerank_warmup, max_promotions, standby_pages, group_reduce,
            spread_weight, principal_bounds, exact_rescore, exact_candidates, head_budgets, unstable_fraction, split_score,
            backend, cuda_graphs, max_cache_len, host_dtype: see :class:`FlexiCacheConfig`.
    """

    def __init__(self, config: Any, profile: HeadProfile | str | os.PathLike | None = None, token_budget: int = 2048,
                 page_size: int = 8, rerank_interval: int = 16, rerank_warmup: int = 0,
                 max_promotions: int | None = None, standby_pages: int | str = "auto", group_reduce: str = "max",
                 spread_weight: float = 0.5, principal_bounds: bool = True, exact_rescore: bool = True,
                 exact_candidates: int = 3, head_budgets: str = "prompt",
                 unstable_fraction: float = DEFAULT_UNSTABLE_FRACTION, split_score: str = "staleness",
                 backend: str = "auto",
                 cuda_graphs: bool = True, max_cache_len: int | None = None, host_dtype: str = "auto") -> None:
        self.settings = FlexiCacheConfig(token_budget=token_budget, page_size=page_size,
                                         rerank_interval=rerank_interval, rerank_warmup=rerank_warmup,
                                         max_promotions=max_promotions, standby_pages=standby_pages,
                                         group_reduce=group_reduce, spread_weight=spread_weight,
                                         principal_bounds=principal_bounds, exact_rescore=exact_rescore,
                                         exact_candidates=exact_candidates, head_budgets=head_budgets,
                                         unstable_fraction=unstable_fraction, split_score=split_score,
                                         backend=backend,
                                         cuda_graphs=cuda_graphs, max_cache_len=max_cache_len, host_dtype=host_dtype)
        if not isinstance(config, PretrainedConfig):
            raise TypeError(f"config must be the model's config (model.config), got {type(config).__name__}; "
                            "FlexiCache.from_model(model) takes the model itself.")
        check_supported_model(config)
        if backend == "flashinfer":
            from flexicache.backends.flashinfer import flashinfer_available

            if not flashinfer_available():
                raise ImportError("backend='flashinfer' needs FlashInfer: pip install 'flexicache-kv[cuda]', "
                                  "or use backend='auto'.")
            require_flashinfer_support(None, model_shape(config)[2])  # the KV dtype is known at the first forward
        online = is_online_profile(profile)
        if not online and self.settings.unstable_fraction != DEFAULT_UNSTABLE_FRACTION:
            raise ValueError(f"unstable_fraction={unstable_fraction!r} sets the share of the online head split "
                             "(profile=None); a profile lists its own unstable heads. Pass profile=None, or profile "
                             "the model with `flexicache profile --fraction` for a profile of that share.")
        if not online and self.settings.split_score != FlexiCacheConfig.split_score:
            raise ValueError(f"split_score={split_score!r} sets how the online head split (profile=None) ranks the "
                             "heads; a profile lists its own unstable heads. Pass profile=None, or leave split_score "
                             "out.")
        self.profile = resolve_profile(None if online else profile, config)  # with online: where a prompt cannot tell
        kinds = layer_kinds(config)
        self.head_split = OnlineHeadSplit(sum(kind.sparse for kind in kinds)) if online else None
        _, num_kv_heads, _ = model_shape(config)
        self.sequence = SequenceState(self.settings.page_size)
        # one backend per device, shared by the layers (its plan too, but for layers with their own split of the pages)
        self.backends: dict[torch.device, DecodeBackend] = {}
        self.step_inputs: dict[torch.device, StepInputs] = {}  # per-step device inputs of the CUDA-graph path
        layers = [
            FlexiLayer(index, self.settings, self.profile.unstable_heads_of(index), num_kv_heads, self.sequence,
                       self.backends, self.step_inputs, self.head_split)
            if kind.sparse else SlidingWindowLayer(index, kind.window)
            for index, kind in enumerate(kinds)
        ]
        Cache.__init__(self, layers=layers)
        hybrid = not all(kind.sparse for kind in kinds)
        if not any(kind.sparse for kind in kinds):
            warnings.warn(NO_SPARSE_LAYERS_WARNING.format(count=len(kinds), windows=sorted({k.window for k in kinds})),
                          UserWarning, stacklevel=2)
        self.step_graphs = StepGraphStore(self._flexi_layers(), self.sequence, self.settings.cuda_graphs,
                                          refusal=HYBRID_REFUSAL if hybrid else None,
                                          max_length=_covering_window(kinds))
        self.closed = False

    @classmethod
    def from_model(cls, model: torch.nn.Module, profile: HeadProfile | str | os.PathLike | None = None,
                   **settings: Any) -> FlexiCache:
        """Switch ``model`` to the flexicache attention and build a cache for it (under tensor parallelism: this
        rank's KV heads, with the profile sliced to them)."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"from_model takes the model (a torch.nn.Module), got {type(model).__name__}; "
                            "FlexiCache(config=...) takes a config.")
        config, profile = local_view(model, profile)
        cache = cls(config, profile=profile, **settings)  # validate first: bad input leaves the model as is
        if model.config._attn_implementation != attention.ATTENTION_NAME:
            model.set_attn_implementation(attention.ATTENTION_NAME)
        if cache.settings.cuda_graphs:
            enable_step_graphs(model)
        return cache

    # ----------------------------------------------------------------------------------------- cache protocol

    def reset(self) -> None:
        handoff.clear_staged()
        self._wait_for_zero_copy_kernels()
        self.sequence.reset()
        self.step_inputs.clear()
        self.step_graphs.reset()
        if self.head_split is not None:
            self.head_split.reset()
        super().reset()

    def close(self) -> None:
        """Free every buffer now (device pages, host tier, graphs); a closed cache refuses any later use. A cache
        nobody refers to is freed without this, when its last reference goes."""
        self.reset()
        for layer in self.layers:
            layer.close()
        self.backends.clear()
        self.closed = True

    def __deepcopy__(self, memo: dict[int, Any]) -> FlexiCache:
        """An independent copy (e.g. one per continuation of a shared prompt); its buffers are made outside inference
        mode whatever mode copies it, like every buffer a cache keeps (they are written in place later)."""
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        with torch.inference_mode(False):
            for name, value in vars(self).items():
                setattr(clone, name, copy.deepcopy(value, memo))
        return clone

    def __enter__(self) -> FlexiCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _flexi_layers(self) -> list[FlexiLayer]:
        """The cache's sparse paged layers (the others, if a model mixes layer types, keep their own semantics)."""
        return [layer for layer in self.layers if isinstance(layer, FlexiLayer)]

    @property
    def sparse_layer_indices(self) -> list[int]:
        """The model layers this cache serves as sparse paged layers (the others are sliding-window layers)."""
        return [index for index, layer in enumerate(self.layers) if isinstance(layer, FlexiLayer)]

    def _sliding_layers(self) -> list[SlidingWindowLayer]:
        """The cache's sliding-window layers (each crops and selects requests itself)."""
        return [layer for layer in self.layers if not isinstance(layer, FlexiLayer)]

    def _wait_for_zero_copy_kernels(self) -> None:
        """Queued zero-copy kernels may still use the pinned host tier about to be freed: wait for them."""
        for layer in self._flexi_layers():
            if layer.is_initialized and layer.storage.offloaded is not None and layer.storage.offloaded.zero_copy:
                torch.cuda.synchronize(layer.device)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(
            "FlexiCache does not support beam search (num_beams > 1): use greedy decoding or sampling, "
            "or DynamicCache for beam search."
        )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``Cache.update`` with the chunk's ``key_states, value_states [B, H, T, D]`` of layer ``layer_idx``; at a
        forward's first paged layer, first the checks of :mod:`flexicache.forward_guard` (state after an error, one
        thread per shared backend, room for the host tiers)."""
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"This FlexiCache was built for a model of {len(self.layers)} decoder layers and got "
                             f"layer {layer_idx}: build it from this model (FlexiCache.from_model(model) or "
                             "FlexiCache(config=model.config)).")
        if layer_idx == self._first_paged_layer and not self.layers[layer_idx].recording and not self.closed:
            self.sequence.check_batch(key_states.shape[0])  # before any layer stages or reads back a chunk
            forward_guard.refuse_use_cache_off(kwargs.get("kwargs"))
            forward_guard.begin_forward(self, self._flexi_layers(), self.sequence, self.step_graphs.failed,
                                        self.head_split, self.backends, key_states)
            forward_guard.adopt_unwrapped_forward(self.step_graphs, key_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @functools.cached_property
    def _first_paged_layer(self) -> int | None:
        """Index of the first sparse paged layer, where a forward's checks run (``None``: the model has none)."""
        return next((layer.layer_idx for layer in self._flexi_layers()), None)

    def holds_tokens(self) -> bool:
        """Whether the cache holds a generation's tokens (not empty, reset or closed)."""
        return not self.closed and self.sequence.num_chunks > 0

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` logical positions (negative count, as transformers passes it), in
        place (:func:`~flexicache.storage_ops.crop_storage`); removing them all resets the cache."""
        tokens_to_remove = integer_argument(tokens_to_remove, "tokens_to_remove", "negative: the tokens to remove")
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}.")
        if tokens_to_remove == 0 or self.sequence.logical_length == 0:
            return
        self._check_usable()
        keep = self.sequence.logical_length + tokens_to_remove
        if keep <= 0:
            self.reset()
            return
        for layer in self._sliding_layers():  # first: a window layer that cannot roll back refuses before any change
            layer.crop(tokens_to_remove)
        before = self.sequence.num_tokens_host
        with self._reset_if_interrupted():
            self.sequence.crop(keep)
            for layer in self._flexi_layers():
                with attention.on_device(layer.device):
                    crop_storage(layer.storage, before, self.sequence.num_tokens_host)
        self._after_storage_change()

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every request ``repeats`` times in place (request ``b`` becomes ``b * repeats .. + repeats - 1``)."""
        repeats = integer_argument(repeats, "repeats", "at least 1")
        if repeats < 1:
            raise ValueError(f"batch_repeat_interleave takes repeats >= 1, got {repeats}.")
        if self.sequence.logical_length and repeats > 1:
            self._select(torch.arange(self.sequence.batch_size).repeat_interleave(repeats))
            for layer in self._sliding_layers():
                layer.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the requests ``indices`` (``[B']`` integer positions, any order, repeats allowed, or a ``[B]`` boolean
        mask)."""
        if self.sequence.logical_length:
            index = _request_index(indices, self.sequence.batch_size)
            self._select(index)
            for layer in self._sliding_layers():
                layer.batch_select_indices(index)

    def _select(self, index: torch.Tensor) -> None:
        """Make every layer's storage that of requests ``index [B']`` (CPU ``long``), one layer at a time."""
        self._check_usable()
        num_tokens = self.sequence.num_tokens_host
        with self._reset_if_interrupted():
            for layer in self._flexi_layers():
                with attention.on_device(layer.device):
                    layer.use_storage(select_requests(layer.storage, index, num_tokens))
            self.sequence.select(index)
        self.step_inputs.clear()  # sized for the old batch
        self._after_storage_change()

    @contextlib.contextmanager
    def _reset_if_interrupted(self) -> Iterator[None]:
        """Around an operation that changes the layers' storage one after another: one that fails part-way (e.g.
        out of memory) leaves layers that no longer agree, so the cache is reset (emptied) before the error goes on."""
        try:
            yield
        except BaseException:
            self.reset()
            raise

    def _check_usable(self) -> None:
        """Refuse a cache operation on a closed cache or one whose last forward stopped part-way."""
        if self.closed:
            raise RuntimeError(CLOSED_MESSAGE)
        forward_guard.check_in_step(self._flexi_layers(), self.sequence, self.step_graphs.failed)

    def _after_storage_change(self) -> None:
        """The layers' storage changed under the recorded whole-step graphs: the next decode step records again."""
        self.step_graphs.clear()

    # --------------------------------------------------------------------------------------------------- stats

    def stats(self) -> dict[str, Any]:
        """Memory and work counters, summed over layers.

        Keys: ``device_kv_bytes`` (KV in use on the device: unstable heads' pages + stable heads' K + C slots, and the
        windows of sliding-window layers), ``device_metadata_bytes`` (page min/max of the pages in use, and the
        ``[B, H, D, D]`` key basis with ``principal_bounds``),
        ``device_reserved_bytes`` (all device tensors, capacity included),
        ``host_kv_bytes`` (stable heads' pages in the host tier), ``host_reserved_bytes``, ``dense_kv_bytes``
        (what DynamicCache would hold: full-attention layers' every token, sliding-window layers' window),
        ``sliding_kv_bytes`` (the sliding-window layers' share of both; 0 in a model without such layers),
        ``reranks_unstable``/``reranks_stable`` (rows reranked: one row is one
        request x one KV head), ``promoted_pages``, ``bytes_h2d``/``bytes_d2h``, ``decode_steps``, ``backend``,
        ``step_graph_captures``/``step_graph_replays`` (decode steps recorded / replayed as whole-step CUDA graphs),
        ``unstable_heads`` (KV heads kept unstable, all layers), ``token_budget``,
        ``host_pool_in_use_bytes``/``host_pool_reserved_bytes`` (the process's pinned host pool: lent to host tiers /
        registered, :mod:`flexicache.host_pool`).
        """
        if self.closed:
            raise RuntimeError(CLOSED_MESSAGE)
        totals: dict[str, Any] = dict.fromkeys(COUNTED_STATS, 0)  # every key, also before the first forward
        for layer in self.layers:
            for name, value in layer.stats().items():
                totals[name] = totals.get(name, 0) + value
        layers = self._flexi_layers()
        totals["decode_steps"] = self.sequence.decode_steps
        backends = sorted({layer.backend.name for layer in layers if layer.is_initialized})
        totals["backend"] = ",".join(backends) if backends else None  # e.g. "flashinfer,reference" on GPU + CPU
        totals["step_graph_captures"] = self.step_graphs.captures
        totals["step_graph_replays"] = self.step_graphs.replays
        totals["unstable_heads"] = sum(len(layer.unstable_heads) for layer in layers)
        totals["token_budget"] = self.settings.token_budget
        totals.update(host_pool().stats())  # the process's pool, shared by every cache on CUDA
        return totals


COUNTED_STATS = ("device_kv_bytes", "device_metadata_bytes", "device_reserved_bytes", "host_kv_bytes",
                 "host_reserved_bytes", "dense_kv_bytes", "sliding_kv_bytes", "reranks_unstable", "reranks_stable",
                 "promoted_pages", "bytes_h2d", "bytes_d2h")  # FlexiCache.stats() keys summed over layers


def _covering_window(kinds: list[LayerKind]) -> int | None:
    """The smallest window of the sliding-window layers served as sparse layers (their window covers
    ``max_position_embeddings``, see :mod:`flexicache.hybrid`), or ``None`` if there are none."""
    windows = [kind.window for kind in kinds if kind.sparse and kind.window is not None]
    return min(windows) if windows else None


def _request_index(indices: object, batch_size: int) -> torch.Tensor:
    """``indices`` (integer positions, negative ones from the end, or a ``[B]`` boolean mask) as a CPU ``long``
    tensor of positions in ``[0, batch_size)``."""
    index = torch.as_tensor(indices).cpu()
    if index.dtype == torch.bool:
        if index.shape != (batch_size,):
            raise ValueError(f"a boolean indices mask must have one entry per request ({batch_size}), got shape "
                             f"{tuple(index.shape)}.")
        index = index.nonzero().view(-1)
    if index.dim() != 1 or index.dtype.is_floating_point or index.dtype.is_complex:
        raise ValueError(f"indices must be a 1-D tensor of request positions (or a boolean mask), got "
                         f"{index.dtype} of shape {tuple(index.shape)}.")
    if index.numel() == 0:
        raise ValueError("indices selects no request; call cache.reset() to empty the cache.")
    index = index.long()  # an unsigned type would wrap the negative bound below
    if bool(((index < -batch_size) | (index >= batch_size)).any()):
        raise IndexError(f"indices {index.tolist()} out of range for a batch of {batch_size} requests.")
    return index % batch_size
