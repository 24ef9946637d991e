"""A dense decode trace: every layer's RoPE-applied query at every decode step, and the keys/values it attended to.

The model runs with a ``DynamicCache`` and the probe attention (:mod:`flexicache.profiling.probe`): the first
``prefill`` tokens in one forward, then the rest of ``token_ids`` one token per forward (teacher forcing), exactly as
decode-mode perplexity feeds them. At step ``s`` the query attended to the first ``prefill + s + 1`` keys, so the
final keys and values of the cache hold every step's context. In a model that mixes layer types only the layers
FlexiCache pages are traced (:func:`flexicache.hybrid.sparse_layers`); sliding-window layers keep their window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from flexicache.hybrid import sparse_layers
from flexicache.models import cache_keyword, input_device
from flexicache.profiling.probe import QueryRecorder, probing


@dataclass
class DecodeTrace:
    """One sequence's dense decode, batch size 1.

    ``queries``: ``[S, L, Hq, D]`` float32, the query of every decode step and traced layer; ``keys``/``values``:
    ``[L, H, T, D]`` float32, the cache after the last step (``T = prefill + S``); ``scaling``: ``[L]`` softmax
    scales; ``layers``: the model layer of each of the ``L`` traced layers. Step ``s`` attends to keys
    ``0 .. prefill + s`` (its own token included).
    """

    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    scaling: list[float]
    prefill: int
    layers: list[int]

    @property
    def num_steps(self) -> int:
        return self.queries.shape[0]

    def context(self, step: int) -> int:
        """Keys visible at decode step ``step``."""
        return self.prefill + step + 1


@torch.no_grad()
def record_trace(model: Any, token_ids: Sequence[int], prefill: int, progress: bool = True) -> DecodeTrace:
    """Prefill ``token_ids[:prefill]`` densely, then feed the remaining tokens one per forward, recording queries."""
    if not 1 <= prefill < len(token_ids):
        raise ValueError(f"prefill must be in [1, {len(token_ids) - 1}] for {len(token_ids)} tokens, got {prefill}")
    device = input_device(model)
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)
    cache = DynamicCache(config=model.config)
    recorder = QueryRecorder()
    keyword = cache_keyword(model)
    layers = sparse_layers(model.config)
    steps: list[torch.Tensor] = []
    with probing(model, recorder):
        model(input_ids=ids[:, :prefill], use_cache=True, **{keyword: cache})
        recorder.pop()
        for position in tqdm(range(prefill, ids.shape[1]), desc="dense decode trace", disable=not progress,
                             leave=False):
            model(input_ids=ids[:, position : position + 1], use_cache=True, **{keyword: cache})
            queries = recorder.pop()
            steps.append(torch.stack([queries[layer][0, :, 0].float().cpu() for layer in layers]))
    keys = torch.stack([cache.layers[layer].keys[0].float().cpu() for layer in layers])
    values = torch.stack([cache.layers[layer].values[0].float().cpu() for layer in layers])
    scaling = [recorder.scaling[layer] for layer in layers]
    return DecodeTrace(torch.stack(steps), keys, values, scaling, prefill, layers)
