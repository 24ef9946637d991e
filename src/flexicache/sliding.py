"""``SlidingWindowLayer``: a sliding-window (or chunked) layer of a FlexiCache, with its type's exact semantics.

In a model that mixes layer types (Gemma 3, Qwen2 with ``use_sliding_window``, Mistral with a window, ...) the
layers typed ``sliding_attention`` or ``chunked_attention`` keep the last ``window - 1`` tokens, as transformers'
``DynamicSlidingWindowLayer`` does (this class is one), and attend densely over them plus the new tokens, through the
mask transformers builds for that layer type. Only the full-attention layers are sparse paged.

The layer stages every update for the ``"flexicache"`` attention function (:mod:`flexicache.handoff`), marked dense:
the function then runs sdpa with the layer's mask, and knows a FlexiCache is in the forward (so it does not warn of
a dense decode without one, and a model that is not running the flexicache attention is caught at the next layer).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from flexicache import handoff
from flexicache.layer import CLOSED_MESSAGE


class SlidingWindowLayer(DynamicSlidingWindowLayer):
    """The last ``sliding_window - 1`` tokens ``[B, H, min(L, W - 1), D]`` of one sliding-window or chunked layer.

    Args:
        layer_idx: the decoder layer's index (what the attention function checks the staged chunk against).
        sliding_window: the layer's window (or attention chunk) in tokens.
    """

    def __init__(self, layer_idx: int, sliding_window: int) -> None:
        super().__init__(sliding_window=sliding_window)
        self.layer_idx = layer_idx
        self.closed = False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the window and stage the new tokens ``[B, H, T, D]`` for the flexicache attention (dense).

        Returns:
            The keys/values the layer's attention reads, ``[B, H, min(L, W - 1) + T, D]`` (its mask selects the
            window).
        """
        if self.closed:
            raise RuntimeError(CLOSED_MESSAGE)
        if self.is_initialized and self.keys.numel() and key_states.shape[0] != self.keys.shape[0]:
            raise ValueError(
                f"FlexiCache holds a batch of {self.keys.shape[0]} requests, got {key_states.shape[0]}: call "
                "cache.reset() (or build a new FlexiCache) before starting another batch."
            )
        start = self.get_seq_length()
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        handoff.stage_dense(self, self.layer_idx, start)
        return keys, values

    def reset(self) -> None:
        """Drop the window (transformers before 5.24 zeroes it in place, and the next update would extend that)."""
        self.keys = self.values = None
        self.is_initialized = False
        self.cumulative_length = 0

    def close(self) -> None:
        """Drop the window now and refuse any later use."""
        self.reset()
        self.closed = True

    def stats(self) -> dict[str, int]:
        """Byte counts of this layer (see :meth:`FlexiCache.stats`): the window it holds counts as device KV, and
        as dense KV (a DynamicCache holds the same window); ``{}`` before the first update."""
        if not self.is_initialized or self.keys.numel() == 0:
            return {}
        held = self.keys.nbytes + self.values.nbytes
        # After a long chunk the window is a view of the chunk's keys/values until the next update replaces it.
        reserved = self.keys.untyped_storage().nbytes() + self.values.untyped_storage().nbytes()
        return {"device_kv_bytes": held, "device_metadata_bytes": 0, "device_reserved_bytes": reserved,
                "host_kv_bytes": 0, "host_reserved_bytes": 0, "dense_kv_bytes": held, "sliding_kv_bytes": held}
