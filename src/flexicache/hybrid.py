"""The layers of a model as FlexiCache serves them, and the model features it refuses.

A decoder's ``layer_types`` (transformers' ``get_layer_types_and_kwargs``) say how each layer attends:

- ``full_attention`` layers become FlexiCache's sparse paged layers (:class:`~flexicache.layer.FlexiLayer`);
- ``sliding_attention`` and ``chunked_attention`` layers keep the semantics of their type: a sliding-window layer of
  the same cache (:class:`~flexicache.sliding.SlidingWindowLayer`, transformers' dynamic sliding layer) holds the
  window and attends densely through the mask transformers builds for that layer type;
- except that when every sliding-window layer's window is at least ``max_position_embeddings`` (Phi-3 128k, whose
  window of 262144 tokens exceeds every sequence the model is configured for; chunked layers never), a
  sliding-window layer attends to every token of any such sequence, i.e. it is a full-attention layer there: those
  layers are sparse paged too, and the flexicache attention refuses a sequence that passes the window.

Any other layer type (linear attention, recurrent state, KV shared with another layer, ...) is refused, as are the
features FlexiCache's sparse decode cannot compute (attention logit softcapping, learned attention sinks,
multi-head latent attention) and encoder-decoder models. The errors say what to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers.cache_utils import get_layer_types_and_kwargs

FULL = "full_attention"
WINDOWED = ("sliding_attention", "chunked_attention")
# Model types (transformers 5.24) whose attention adds learned per-head sink logits to the softmax (`s_aux`).
ATTENTION_SINK_MODEL_TYPES = ("deepseek_v4", "flint", "gpt_oss", "granite_swa", "granitemoe_swa", "hy_v4",
                              "hy_v4_vl", "mimo_v2_flash", "openai_privacy_filter")


@dataclass(frozen=True)
class LayerKind:
    """How FlexiCache serves one decoder layer.

    Attributes:
        layer_type: the model's type of the layer (``"full_attention"``, ``"sliding_attention"``, ...).
        window: the sliding window (or attention chunk) in tokens; ``None`` for full attention.
        sparse: whether the layer is a sparse paged :class:`~flexicache.layer.FlexiLayer` (else a sliding layer).
    """

    layer_type: str
    window: int | None
    sparse: bool


def text_config_of(config: Any) -> Any:
    """The decoder config of ``config`` (itself for a plain text model)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def layer_kinds(config: Any) -> list[LayerKind]:
    """One :class:`LayerKind` per decoder layer of the model ``config`` (layer types outside
    ``full_attention``/``sliding_attention``/``chunked_attention`` raise, see :func:`check_supported_model`)."""
    text_config = text_config_of(config)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
    if isinstance(layer_kwargs, dict):  # transformers before 5.24: one kwargs dict for all layers
        layer_kwargs = [layer_kwargs] * len(layer_types)
    unsupported = sorted({kind for kind in layer_types if kind != FULL and kind not in WINDOWED})
    if len(layer_types) != text_config.num_hidden_layers:  # older transformers leave out KV-sharing layers
        unsupported.append("KV shared between layers")
    if unsupported:
        raise ValueError(
            f"FlexiCache serves full-attention layers (sparse pages) and sliding-window or chunked layers (their "
            f"window), but this model has {unsupported} layers (linear attention, recurrent state, KV shared "
            "between layers or another cache layout): use DynamicCache for this model."
        )
    windows = [kwargs.get("sliding_window") if kind in WINDOWED else None
               for kind, kwargs in zip(layer_types, layer_kwargs, strict=True)]
    limit = getattr(text_config, "max_position_embeddings", None)
    sliding = [window for kind, window in zip(layer_types, windows) if kind == "sliding_attention"]
    # A window no sequence of the configured length can exceed is full attention for every such sequence. All sliding
    # layers or none: the model builds one sliding mask, sized by the first layer the cache reports as sliding.
    covering = (bool(sliding) and "chunked_attention" not in layer_types and limit is not None
                and all(window >= limit for window in sliding))
    return [LayerKind(kind, window, kind == FULL or (covering and kind == "sliding_attention"))
            for kind, window in zip(layer_types, windows)]


def sparse_layers(config: Any) -> list[int]:
    """The model layers FlexiCache serves as sparse paged layers (what a head profile covers), ascending."""
    return [index for index, kind in enumerate(layer_kinds(config)) if kind.sparse]


def check_supported_model(config: Any) -> None:
    """Raise ``ValueError`` for a model FlexiCache cannot serve, naming the feature and what to do instead."""
    text_config = text_config_of(config)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("FlexiCache supports decoder-only models; encoder-decoder models need EncoderDecoderCache.")
    if getattr(text_config, "kv_lora_rank", None):
        raise ValueError("FlexiCache does not support multi-head latent attention (MLA) models; use DynamicCache.")
    softcap = getattr(text_config, "attn_logit_softcapping", None)
    if softcap is not None:
        raise ValueError(
            f"This model caps its attention logits (attn_logit_softcapping={softcap}, e.g. Gemma 2), which neither "
            "FlexiCache's sparse decode nor sdpa computes. Use DynamicCache with attn_implementation=\"eager\", or "
            "set config.attn_logit_softcapping = None before loading the model if softcap-free attention is "
            "acceptable (the model was trained with the cap: its outputs change)."
        )
    model_type = getattr(text_config, "model_type", None)
    if model_type in ATTENTION_SINK_MODEL_TYPES:
        raise ValueError(
            f"{model_type} models add learned attention-sink logits to every softmax (s_aux), which FlexiCache's "
            "sparse decode does not compute: use DynamicCache with this model's own attention implementation."
        )
    layer_kinds(text_config)
