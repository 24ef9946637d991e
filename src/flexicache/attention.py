"""The ``"flexicache"`` attention function registered with transformers, and its hand-off from the cache.

transformers calls ``cache.update(k, v, layer_idx)`` and then the attention function, which receives the module
but not the cache. ``FlexiLayer.update`` therefore stages the chunk it received here (per thread), and the
attention function takes it back, checking the layer index. A staged chunk that nobody takes means the model is
not running the flexicache attention: the next ``update`` raises with instructions.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

if TYPE_CHECKING:
    from flexicache.cache import FlexiLayer


ATTENTION_NAME = "flexicache"
SWITCH_HINT = (
    "Load the model with attn_implementation=\"flexicache\" (after `import flexicache`), call "
    "model.set_attn_implementation(\"flexicache\"), or build the cache with FlexiCache.from_model(model, ...)."
)
UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks", "sliding_window")


@dataclass
class StagedChunk:
    """Keys/values ``[B, H, T, D]`` that ``FlexiLayer.update`` received, waiting for the attention function."""

    layer: FlexiLayer
    layer_idx: int
    keys: torch.Tensor
    values: torch.Tensor
    logical_start: int

    @property
    def is_decode(self) -> bool:
        return self.keys.shape[2] == 1 and self.logical_start > 0


_local = threading.local()


def stage(chunk: StagedChunk) -> None:
    """Called by ``FlexiLayer.update``; fails if the previous layer's chunk was never attended to."""
    previous = getattr(_local, "chunk", None)
    _local.chunk = chunk
    if previous is not None:
        _local.chunk = None  # drop both: once the model is switched, the next forward must not fail again
        raise RuntimeError(
            f"FlexiCache layer {previous.layer_idx} was updated but its attention did not run through the "
            f"flexicache attention function: the model uses another attn_implementation. {SWITCH_HINT}"
        )


def clear_staged() -> None:
    """Drop a staged chunk (after an interrupted forward, or on cache reset)."""
    _local.chunk = None


def _take(layer_idx: int | None) -> StagedChunk | None:
    chunk = getattr(_local, "chunk", None)
    if chunk is None:
        return None
    if layer_idx is not None and chunk.layer_idx != layer_idx:
        raise RuntimeError(
            f"flexicache attention of layer {layer_idx} found the cache update of layer {chunk.layer_idx}; the "
            "model must call cache.update(...) and then its attention, layer by layer."
        )
    _local.chunk = None
    return chunk


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` current for kernels that launch on the current CUDA device (Triton, FlashInfer): a layer
    of a model split over GPUs must run its kernels on its own GPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def real_tokens_of_chunk(attention_mask: torch.Tensor | None, start: int, length: int) -> torch.Tensor | None:
    """``[B, T]`` bool, True where a chunk token is real (not padding); ``None`` when all are real.

    A key column is padding iff the last query row of the chunk (always a real token under left padding) may not
    attend to it.
    """
    if attention_mask is None or attention_mask.dim() != 4:
        return None
    row = attention_mask[:, 0, -1, start : start + length]
    if row.dtype != torch.bool:
        row = row > torch.finfo(row.dtype).min / 2
    if row.shape[-1] != length:
        raise ValueError(f"attention mask covers {row.shape[-1]} of the chunk's {length} key positions")
    return None if bool(row.all()) else row


def flexicache_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Dense sdpa for prefill (and without a FlexiCache); sparse paged attention for a single decode token.

    Args:
        query: ``[B, Hq, T, D]``; key/value: what the cache's ``update`` returned.

    Returns:
        ``([B, T, Hq, D], None)`` like transformers' attention functions.
    """
    chunk = _take(getattr(module, "layer_idx", None))
    if chunk is None:  # no FlexiCache in this forward (e.g. DynamicCache or use_cache=False)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    for name in UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"FlexiCache does not support attention with `{name}`; use DynamicCache.")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer = chunk.layer
    with on_device(query.device):  # kernels launch on the current CUDA device: make it this layer's
        if chunk.is_decode:
            return layer.decode(chunk, query, scale), None
        real = real_tokens_of_chunk(attention_mask, chunk.logical_start, chunk.keys.shape[2])
        layer.commit(chunk, query, real_tokens=real)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scale, dropout=dropout, **kwargs)


def register() -> None:
    """Register ``"flexicache"`` as an attention implementation and its (sdpa) mask function."""
    AttentionInterface.register(ATTENTION_NAME, flexicache_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
