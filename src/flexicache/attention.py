"""The ``"flexicache"`` attention function registered with transformers.

Prefill chunks (several query tokens) are committed into the cache's pages, then run dense sdpa; a
single-token decode step on a non-empty FlexiCache runs the layer's sparse paged decode. The chunk comes from the
cache's ``update`` through :mod:`flexicache.handoff`. A sliding-window layer of a hybrid model stages a dense chunk:
its attention is sdpa over its window, with the mask transformers built for its layer type. Without a FlexiCache in
the forward the function is sdpa.

Attention features beyond a scaled softmax are refused per feature (:func:`check_attention_kwargs`): logit
softcapping and learned sinks (neither the sparse decode nor sdpa computes them); a sliding window on a sparse layer
only while the sequence fits in it (see :mod:`flexicache.hybrid`). The softmax scale is the one the model passes
(e.g. Gemma's ``query_pre_attn_scalar ** -0.5``), in the dense and the sparse paths alike.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from flexicache import handoff
from flexicache.warn_once import warn_once

ATTENTION_NAME = "flexicache"
UNSUPPORTED_KWARGS = {
    "softcap": "attention logit softcapping (Gemma 2's attn_logit_softcapping)",
    "s_aux": "learned attention sinks (gpt-oss)",
    "sinks": "learned attention sinks",
}
DENSE_DECODE_WARNING = (
    "The model runs the \"flexicache\" attention, but no FlexiCache was passed: this decode step (and every later "
    "one) attends densely over the whole context, like sdpa. Pass a cache to generate: "
    "model.generate(..., past_key_values=FlexiCache.from_model(model, token_budget=...)) (or cache= from "
    "transformers 5.24); set the model back to \"sdpa\" to silence this for dense runs."
)

NO_GRADIENT_WARNING = (
    "FlexiCache's sparse decode attention is not differentiable: gradients do not flow through the attention of "
    "decode steps (the prompt's dense attention is differentiable). Use DynamicCache where gradients must pass "
    "through decoded tokens, or decode under torch.no_grad()."
)


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


def _warn_dense_decode(query: torch.Tensor, key: torch.Tensor) -> None:
    """Warn (once) when a decode step (one query token over a longer cache) runs dense for want of a FlexiCache."""
    if query.shape[2] == 1 and key.shape[2] > 1:
        warn_once(DENSE_DECODE_WARNING, UserWarning, stacklevel=3)


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
    chunk = handoff.take(getattr(module, "layer_idx", None))
    layer = None if chunk is None else chunk.layer
    if layer is None:  # no FlexiCache in this forward (e.g. DynamicCache or use_cache=False)
        _warn_dense_decode(query, key)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    check_attention_kwargs(kwargs, chunk)
    if chunk.dense:  # a sliding-window layer: its window, its mask
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    with on_device(query.device):  # kernels launch on the current CUDA device: make it this layer's
        if chunk.is_decode:
            if query.requires_grad:
                warn_once(NO_GRADIENT_WARNING, UserWarning, stacklevel=2)
            return layer.decode(chunk, query, scale), None
        real = real_tokens_of_chunk(attention_mask, chunk.logical_start, chunk.keys.shape[2])
        layer.commit(chunk, query, real_tokens=real)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scale, dropout=dropout, **kwargs)


def check_attention_kwargs(kwargs: dict[str, Any], chunk: handoff.StagedChunk) -> None:
    """Refuse what the attention of a FlexiCache layer cannot compute, naming the feature.

    A sparse layer that receives a ``sliding_window`` (a sliding-window layer served as full attention because its
    window covers ``max_position_embeddings``) attends to every token: that is its window only while the sequence
    (padding included, as the model's mask counts it) fits in the window.
    """
    for name, feature in UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"FlexiCache does not support {feature} (the attention received `{name}`): use DynamicCache with "
                "this model's own attention implementation."
            )
    window = kwargs.get("sliding_window")
    if window is not None and not chunk.dense and chunk.logical_start + chunk.keys.shape[2] > window:
        raise ValueError(
            f"Layer {chunk.layer_idx} is a sliding-window layer (window {window}) that FlexiCache serves as full "
            f"attention, since its window covers the model's max_position_embeddings; this sequence reached "
            f"{chunk.logical_start + chunk.keys.shape[2]} positions, past the window, where the layer would no longer "
            "see exactly its window. Keep prompt + new tokens within max_position_embeddings, or use DynamicCache."
        )


def register() -> None:
    """Register ``"flexicache"`` as an attention implementation and its (sdpa) mask function."""
    AttentionInterface.register(ATTENTION_NAME, flexicache_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
