"""A registered attention function that records each layer's (RoPE-applied) query, then runs transformers' sdpa.

``probing(model, recorder)`` switches the model to the probe and back; while it is active every attention call
hands its query to ``recorder``. Decode calls (one query token) are always recorded; prefill calls record only the
last ``recorder.prefill_tail`` query positions (0: none).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PROBE_NAME = "flexicache_probe"


class QueryRecorder:
    """Queries of the current forward pass, by layer: ``queries[layer]`` is ``[B, Hq, Tq, D]``.

    ``Tq`` is 1 at decode and ``min(prefill_tail, prompt length)`` at prefill. ``scaling[layer]`` is the softmax
    scale the model passed to the attention function. Call :meth:`pop` after each forward pass.
    """

    def __init__(self, prefill_tail: int = 0) -> None:
        self.prefill_tail = prefill_tail
        self.queries: dict[int, torch.Tensor] = {}
        self.scaling: dict[int, float] = {}

    def record(self, layer_idx: int, query: torch.Tensor, scaling: float | None) -> None:
        length = query.shape[2]
        if length > 1:
            if self.prefill_tail <= 0:
                return
            query = query[:, :, -self.prefill_tail :]
        self.queries[layer_idx] = query.detach()
        self.scaling[layer_idx] = scaling if scaling is not None else query.shape[-1] ** -0.5

    def pop(self) -> dict[int, torch.Tensor]:
        """The queries recorded since the last call, then forget them."""
        queries, self.queries = self.queries, {}
        return queries


_ACTIVE: ContextVar[QueryRecorder | None] = ContextVar("flexicache_probe_recorder", default=None)


def probe_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Record ``query`` ``[B, Hq, T, D]`` for ``module.layer_idx``, then return sdpa's ``(out [B, T, Hq, D], None)``."""
    recorder = _ACTIVE.get()
    if recorder is not None:
        recorder.record(module.layer_idx, query, scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def register_probe() -> None:
    """Register the probe and its (sdpa) mask function under :data:`PROBE_NAME`; idempotent."""
    AttentionInterface.register(PROBE_NAME, probe_attention_forward)
    AttentionMaskInterface.register(PROBE_NAME, sdpa_mask)


@contextmanager
def probing(model: Any, recorder: QueryRecorder) -> Iterator[QueryRecorder]:
    """Run ``model`` with the probe attention, recording into ``recorder``; restores the original implementation."""
    register_probe()
    original = model.config._attn_implementation
    model.set_attn_implementation(PROBE_NAME)
    token = _ACTIVE.set(recorder)
    try:
        yield recorder
    finally:
        _ACTIVE.reset(token)
        model.set_attn_implementation(original)
