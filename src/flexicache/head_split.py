"""The split of KV heads into stable and unstable ones estimated from the prompt itself (``profile="online"``, the
behaviour without a profile).

A cache without a measured :class:`~flexicache.profile.HeadProfile` decides each sparse layer's unstable heads at its
first prompt chunk, in the flexicache attention, before the chunk is stored: the last :data:`WINDOW` prompt
positions are treated as decode steps, and the stability of each head's top-K page sets between neighbouring
positions (:func:`flexicache.profiling.online.prompt_stability`, the offline profiler's measure, with the pages
scored by the cache's ``spread_weight`` in the model's axes) ranks the heads.
The layers decide one after another within the prefill forward, so the fraction is kept over the heads seen so far:
a layer's head is unstable when its score is within the lowest :data:`UNSTABLE_FRACTION` of all scores of this and the
earlier layers (ties at the threshold: as many as keep the count of unstable heads at that fraction), and the count so
far stays within one layer's heads of that fraction (layers whose scores rise or fall with depth). A layer whose
prompt is too short to tell (no more pages than the budget holds) keeps the default profile's heads
(:meth:`HeadProfile.default`), as does a cache whose first chunk is a single token. One split serves a batch (the
requests' scores averaged), so a request in a batch can decode differently from the same request alone; a fixed
profile keeps them equal. A chunked prefill is estimated from its first chunk.
"""

from __future__ import annotations

import math

import torch

from flexicache.config import FlexiCacheConfig
from flexicache.profiling.online import prompt_stability

WINDOW = 64  # prompt-tail query positions the estimate reads
UNSTABLE_FRACTION = 0.25  # of the heads seen so far, as the offline profiler's default
MAX_DISTANCE = 16  # step distances the stability is averaged over (the rerank interval's default)


class OnlineHeadSplit:
    """The running decision of one cache's first prefill forward, shared by its layers (:meth:`reset` for a new
    prompt)."""

    def __init__(self) -> None:
        self.scores: list[float] = []  # the finite scores of every head decided so far
        self.num_unstable = 0  # of those, the heads made unstable

    def reset(self) -> None:
        self.scores.clear()
        self.num_unstable = 0

    def unstable_heads(self, query: torch.Tensor, keys: torch.Tensor, real_tokens: torch.Tensor | None,
                       settings: FlexiCacheConfig, fallback: list[int]) -> list[int]:
        """This layer's unstable heads from its first prompt chunk.

        Args:
            query: ``[B, Hq, T, D]`` the chunk's queries; keys: ``[B, H, T, D]`` (RoPE applied).
            real_tokens: ``[B, T]`` bool (``None``: all real); each request is estimated over its real tokens and
                the scores averaged over the batch (one split serves every request).
            fallback: the heads to keep when the prompt is too short to tell.
        """
        scores = request_stability(query, keys, real_tokens, settings).nanmean(dim=0).cpu()  # [H]
        finite = [(head, float(score)) for head, score in enumerate(scores.tolist()) if math.isfinite(score)]
        if not finite:
            return list(fallback)
        self.scores.extend(score for _, score in finite)
        target = max(1, math.ceil(UNSTABLE_FRACTION * len(self.scores)))  # unstable heads so far, this layer's too
        threshold = sorted(self.scores)[target - 1]
        ranked = sorted(finite, key=lambda item: item[1])
        below = sum(score < threshold for _, score in ranked)
        ties = sum(score == threshold for _, score in ranked)  # as many as the fraction still allows
        wanted = below + min(ties, max(0, target - self.num_unstable - below))
        # the running count stays within one layer's heads of the target, whatever order the layers' scores come in
        slack = keys.shape[1]
        count = min(max(wanted, target - slack - self.num_unstable), target + slack - self.num_unstable, len(ranked))
        count = max(count, 0)
        self.num_unstable += count
        return sorted(head for head, _ in ranked[:count])


def request_stability(query: torch.Tensor, keys: torch.Tensor, real_tokens: torch.Tensor | None,
                      settings: FlexiCacheConfig) -> torch.Tensor:
    """``[B, H]`` stability of each request's heads (``nan``: too few pages to tell), each over its real tokens, from
    ``query [B, Hq, T, D]`` and ``keys [B, H, T, D]`` (left on their device: the caller syncs once per layer)."""
    if real_tokens is None:  # no padding: every request at once
        return _stability(query, keys, settings)
    length = keys.shape[2]  # left padding: the real tokens are the last ones
    return torch.stack([_stability(query[request, None, :, length - real:], keys[request, None, :, length - real:],
                                   settings)[0]
                        for request, real in enumerate(real_tokens.sum(dim=1).tolist())])


def _stability(query: torch.Tensor, keys: torch.Tensor, settings: FlexiCacheConfig) -> torch.Tensor:
    """``[B, H]`` :func:`~flexicache.profiling.online.prompt_stability` of requests without padding."""
    if keys.shape[2] < 2:
        return torch.full(keys.shape[:2], float("nan"), device=keys.device)
    window = min(WINDOW, query.shape[2])
    return prompt_stability(query[:, :, -window:].float(), keys, settings.token_budget, settings.page_size,
                            MAX_DISTANCE, settings.group_reduce, settings.spread_weight)
