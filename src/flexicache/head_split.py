"""The split of KV heads into stable and unstable ones estimated from the prompt itself (``profile="online"``, the
behaviour without a profile).

A cache without a measured :class:`~flexicache.profile.HeadProfile` decides its unstable heads from its first prompt
forward. In each sparse layer the last :data:`WINDOW` prompt positions are treated as decode steps, and each head
gets a score (the cache's ``split_score``): by default the attention mass it would lose as a stable head, its working
set going stale between reranks, against what it would lose as an unstable head
(:func:`flexicache.profiling.staleness.prompt_staleness_gain`, negated); with ``"overlap"`` the stability of its top-K
page sets between neighbouring positions (:func:`flexicache.profiling.online.prompt_stability`, the offline profiler's
measure). Pages are scored by the cache's ``spread_weight`` in the model's axes. The heads of lowest score, the
cache's ``unstable_fraction`` of the scored heads (a quarter by default) wherever they are in the model (as the
offline profiler ranks them) but never fewer than :meth:`HeadProfile.default` makes unstable, become unstable. A model
with fewer than :data:`MIN_SPLIT_HEADS` paged heads keeps them all unstable: Gemma-3-270M (one global layer in six,
one KV head each: three paged heads) with two unstable, the default profile's floor, was 1.008 and 1.043 of dense
perplexity at 1/8 on two pairs of files (the prompt kept the middle global layer's head stable on ``dataclasses.py``,
where its working set went stale: 1.085), with all three 1.005 and 1.002 (eval/RESULTS.md); the one stable head would
have saved a third of 3 KiB of bf16 KV per token.

That choice needs every layer's scores, and a layer's storage needs its split. So each layer *parks* its first chunk
(:class:`OnlineHeadSplit`: its keys and values, its last query) when it has scored its heads, and the last sparse
layer of the forward decides and commits every parked chunk, layer by layer, before its own attention returns. Until
then the first chunk's KV of every layer stays where the model computed it: a one-shot prompt holds what a
``DynamicCache`` would during its forward, a chunked prefill only its first chunk (the split is estimated from it).
A forward that ends before every parked chunk is stored (an error, a model with fewer layers than the cache's
config) makes the cache's next forward raise until ``cache.reset()``; that forward drops the chunks still parked.
Parked keys and values are compact: a view into a larger activation (a fused QKV projection's output) is copied, so
parking holds no more than the keys and values themselves.
A layer whose prompt is too short to tell (no more pages than the budget holds) keeps the default profile's heads
(:meth:`HeadProfile.default`), as does a cache whose first chunk is a single token. One split serves a batch (the
requests' scores averaged), so a request in a batch can decode differently from the same request alone; a fixed
profile keeps them equal. With tensor parallelism each rank's cache splits the heads it holds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flexicache.config import PROMPT_TAIL_QUERIES, FlexiCacheConfig
from flexicache.handoff import StagedChunk
from flexicache.profiling.online import prompt_stability
from flexicache.profiling.pages import tail_page_mass
from flexicache.profiling.staleness import prompt_staleness_gain
from flexicache.profiling.stability import lowest_count

WINDOW = PROMPT_TAIL_QUERIES  # prompt-tail query positions the estimate reads (those the page split reads)
MAX_DISTANCE = 16  # step distances the stability is averaged over (the rerank interval's default)
# A cache with fewer paged KV heads makes them all unstable: a quarter of them is less than one head, the default
# profile's floor leaves at most one stable, and the prompt's pick among so few was measured wrong (Gemma-3-270M).
MIN_SPLIT_HEADS = 4


@dataclass
class ParkedChunk:
    """A layer's first prompt chunk, waiting for the other layers' head scores.

    The chunk holds its layer weakly (a parked chunk does not keep a dropped cache's layers alive).
    """

    chunk: StagedChunk  # keys/values [B, H, T, D], each owning its storage
    last_query: torch.Tensor  # [B, Hq, 1, D]: seeds the stable heads' selection at the commit
    real_tokens: torch.Tensor | None  # [B, T] bool, None: all real
    scores: torch.Tensor  # [H] the heads' stability, averaged over the batch (nan: too few pages to tell)
    fallback: list[int]  # the heads to make unstable when no head has a score

    @property
    def layer(self) -> Any:
        return self.chunk.layer


class OnlineHeadSplit:
    """The parked first chunks of one cache's first prefill forward, and the split they decide (:meth:`reset` for a
    new prompt).

    Args:
        num_layers: the cache's sparse layers (each parks once per first forward).
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.parked: list[ParkedChunk] = []
        self.abandoned: list[int] = []  # layers whose parked chunks an interrupted forward left (dropped)

    def reset(self) -> None:
        self.parked.clear()
        self.abandoned.clear()

    @property
    def interrupted(self) -> bool:
        """Whether a forward ended with first chunks parked (stored nothing of them): the cache is unusable."""
        return bool(self.parked or self.abandoned)

    def abandon(self) -> list[int]:
        """Drop the chunks an interrupted forward left parked (their memory is freed) and return every layer that
        parked one; :attr:`interrupted` stays true until :meth:`reset`."""
        self.abandoned += [entry.chunk.layer_idx for entry in self.parked]
        self.parked.clear()
        return list(self.abandoned)

    def release_first(self) -> None:
        """The first parked chunk is stored: drop it (a failure before this leaves it parked)."""
        self.parked.pop(0)

    def park(self, chunk: StagedChunk, query: torch.Tensor, real_tokens: torch.Tensor | None,
             settings: FlexiCacheConfig, fallback: list[int], tail_mass: list[torch.Tensor] | None = None
             ) -> list[list[int]]:
        """Score a layer's heads from its first prompt chunk (staged by that layer) and park the chunk.

        Args:
            query: ``[B, Hq, T, D]`` the chunk's queries (RoPE applied; the last :data:`WINDOW` are read).
            real_tokens: ``[B, T]`` bool (``None``: all real); each request is estimated over its real tokens.
            fallback: this layer's heads to keep when its prompt is too short to tell.
            tail_mass: the chunk's :func:`~flexicache.profiling.pages.tail_page_mass`, where the caller has it.

        Returns:
            Empty until every layer has parked; then each parked chunk's unstable heads, in the order parked. The
            chunks stay in :attr:`parked` until the caller stores them, each followed by :meth:`release_first`.
        """
        scores = request_stability(query, chunk.keys, real_tokens, settings, tail_mass).nanmean(dim=0)  # [H]
        compact = dataclasses.replace(chunk, keys=_owning(chunk.keys), values=_owning(chunk.values))
        self.parked.append(ParkedChunk(compact, query[:, :, -1:].clone(),
                                       None if real_tokens is None else _owning(real_tokens), scores, list(fallback)))
        if len(self.parked) < self.num_layers:
            return []
        return unstable_heads_by_score([entry.scores.cpu() for entry in self.parked],
                                       [entry.fallback for entry in self.parked], settings.unstable_fraction)


def unstable_heads_by_score(scores: Sequence[torch.Tensor], fallbacks: Sequence[list[int]],
                            fraction: float) -> list[list[int]]:
    """Each layer's unstable heads: the lowest scores over all layers' heads (:func:`unstable_count` of them).

    Args:
        scores: per layer ``[H]`` head scores (``nan``: cannot tell; such a head stays stable).
        fallbacks: per layer, the heads to make unstable when none of the layer's heads has a score.
        fraction: the share of the scored heads to make unstable (the cache's ``unstable_fraction``).

    Returns:
        Per layer, ascending head indices: :func:`unstable_count` of the scored heads, where the fallbacks of the
        scored layers give the default profile's count; every head when there are too few (:func:`too_few_to_split`).
        Equal scores go to the earlier layer and head first.
    """
    if too_few_to_split(sum(row.numel() for row in scores)):
        return [list(range(row.numel())) for row in scores]
    finite = [(float(score), layer, head) for layer, row in enumerate(scores)
              for head, score in enumerate(row.tolist()) if math.isfinite(score)]
    scored = {layer for _, layer, _ in finite}
    chosen = sorted(finite)[:unstable_count(len(finite), sum(len(fallbacks[layer]) for layer in scored), fraction)]
    unstable: list[list[int]] = [[] for _ in scores]
    for _, layer, head in chosen:
        unstable[layer].append(head)
    return [sorted(heads) if torch.isfinite(row).any() else list(fallback)
            for heads, row, fallback in zip(unstable, scores, fallbacks, strict=True)]


def unstable_count(num_scored: int, default_count: int, fraction: float) -> int:
    """How many of ``num_scored`` heads the split makes unstable: ``fraction`` of them (rounded as the offline
    profiler rounds, :func:`~flexicache.profiling.stability.lowest_count`), at least one, and at least
    ``default_count`` (what :meth:`HeadProfile.default` makes unstable among their layers)."""
    return min(num_scored, max(1, lowest_count(num_scored, fraction), default_count)) if num_scored else 0


def too_few_to_split(num_heads: int) -> bool:
    """Whether a cache of ``num_heads`` paged KV heads keeps them all unstable (:data:`MIN_SPLIT_HEADS`)."""
    return num_heads < MIN_SPLIT_HEADS


def _owning(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a copy of it where it is a view into a larger storage (which parking would keep alive)."""
    return tensor.clone() if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size() else tensor


def request_stability(query: torch.Tensor, keys: torch.Tensor, real_tokens: torch.Tensor | None,
                      settings: FlexiCacheConfig, tail_mass: list[torch.Tensor] | None = None) -> torch.Tensor:
    """``[B, H]`` stability of each request's heads (``nan``: too few pages to tell), each over its real tokens, from
    ``query [B, Hq, T, D]`` and ``keys [B, H, T, D]`` (left on their device: without padding the split syncs once,
    at its decision; a padded request's real tokens are gathered with a sync per layer). ``tail_mass``: the chunk's
    :func:`~flexicache.profiling.pages.tail_page_mass` over :data:`WINDOW` queries where the caller has it (the
    staleness score reads it; computed here otherwise)."""
    if settings.split_score != "staleness":
        tail_mass = None  # the overlap score does not read it
    elif tail_mass is None and keys.shape[2] > 1:
        tail_mass = tail_page_mass(query, keys, real_tokens, settings.page_size, WINDOW)
    if real_tokens is None:  # no padding: every request at once
        return _stability(query, keys, settings, None if tail_mass is None else torch.stack(tail_mass))
    return torch.stack([_stability(query[request, None][:, :, real], keys[request, None][:, :, real], settings,
                                   None if tail_mass is None else tail_mass[request][None])[0]
                        for request, real in enumerate(real_tokens.to(keys.device))])


def _stability(query: torch.Tensor, keys: torch.Tensor, settings: FlexiCacheConfig,
               tail_mass: torch.Tensor | None) -> torch.Tensor:
    """``[B, H]`` stability of requests without padding (lower: unstable first): with ``split_score="staleness"``
    the negated :func:`~flexicache.profiling.staleness.prompt_staleness_gain` (``tail_mass [B, H, W, P]``), with
    ``"overlap"`` :func:`~flexicache.profiling.online.prompt_stability`."""
    if keys.shape[2] < 2:
        return torch.full(keys.shape[:2], float("nan"), device=keys.device)
    window = min(WINDOW, query.shape[2])
    if settings.split_score == "staleness":
        return -prompt_staleness_gain(query[:, :, -window:], keys, tail_mass, settings.pages_per_head,
                                      settings.num_standby_pages, settings.candidate_pages, settings.page_size,
                                      settings.rerank_interval, group_reduce=settings.group_reduce,
                                      spread_weight=settings.spread_weight)
    return prompt_stability(query[:, :, -window:].float(), keys, settings.token_budget, settings.page_size,
                            MAX_DISTANCE, settings.group_reduce, settings.spread_weight)
