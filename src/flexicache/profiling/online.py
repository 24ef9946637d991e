"""Head stability estimated at prefill from the prompt itself (beyond the paper), and its agreement with a profile.

Every query position ``p`` of the prompt tail is treated like a decode step over the pages that exist at ``p``
(``p // page_size + 1`` of them, the one holding ``p`` forced as the tail); the top-K sets of neighbouring tail
positions are compared with the same RCO as the offline profiler. FlexiCache's online split
(:mod:`flexicache.head_split`) calls :func:`prompt_stability` per layer at prefill;
:func:`estimate_unstable_heads_from_prompt` is an analysis helper over all layers of a batch, each request's heads
split on their own (Quest's bound, no floor on the count), not what a cache does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from flexicache.config import DEFAULT_UNSTABLE_FRACTION
from flexicache.profile import HeadProfile
from flexicache.profiling.pages import page_bounds
from flexicache.profiling.stability import lowest_count, rco_by_distance
from flexicache.selection import GroupReduce, box_scores, reduce_group, select_pages


def prompt_page_sets(
    query: torch.Tensor, key: torch.Tensor, token_budget: int, page_size: int = 16, group_reduce: GroupReduce = "max",
    spread_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K pages of each prompt-tail query over the pages that exist at its position.

    Args:
        query: ``[B, Hq, W, D]`` queries of the last ``W`` prompt positions (RoPE applied).
        key: ``[B, H, T, D]`` keys of the whole prompt (``T >= W``), pages starting at position 0 (any float dtype:
            their page boxes are taken in it and scored in the query's).
        spread_weight: how the pages are scored (:func:`~flexicache.selection.quest_page_scores`; 1: Quest's bound).

    Returns:
        ``(pages [W, B, H, min(K, P)], num_pages [W])`` with ``K = token_budget // page_size`` (``num_pages`` on
        the host).
    """
    batch, heads, length, dim = key.shape
    window, group = query.shape[2], query.shape[1] // heads
    kmin, kmax = (bound.to(query.dtype) for bound in page_bounds(key, page_size))  # [B, H, P, D], exact
    num_pages = kmin.shape[2]
    rows = batch * heads * window
    # every tail query of a row against that row's boxes in one product (no copy of the boxes per query)
    queries = query.view(batch, heads, group, window, dim).transpose(2, 3).reshape(batch * heads, window * group, dim)
    boxes = (box.reshape(batch * heads, num_pages, dim) for box in (kmin, kmax))
    scores = box_scores(queries, *boxes, spread_weight)
    scores = reduce_group(scores.view(rows, group, num_pages), group_reduce)
    counts = torch.arange(length - window, length) // page_size + 1  # [W] (on the host: no sync)
    pages, _ = select_pages(scores, counts.to(key.device).repeat(batch * heads), token_budget // page_size)
    return pages.view(batch, heads, window, -1).permute(2, 0, 1, 3), counts


def prompt_stability(
    query: torch.Tensor,
    key: torch.Tensor,
    token_budget: int,
    page_size: int = 16,
    max_distance: int = 16,
    group_reduce: GroupReduce = "max",
    spread_weight: float = 1.0,
) -> torch.Tensor:
    """Stability score ``[B, H]`` of one layer from its prompt tail: mean RCO over tail positions ``d`` apart.

    Args: as :func:`prompt_page_sets`. ``nan`` where the prompt has too few pages (``N <= K``) to tell.
    """
    pages, counts = prompt_page_sets(query, key, token_budget, page_size, group_reduce, spread_weight)
    distance = max(1, min(max_distance, pages.shape[0] - 1))
    curve, _ = rco_by_distance(pages, counts, token_budget // page_size, distance)
    return curve.nanmean(dim=0).to(torch.float32)


class PromptEstimate(NamedTuple):
    scores: torch.Tensor  # [L, B, H] estimated stability (higher: more stable)
    unstable: torch.Tensor  # [L, B, H] bool: per request, the `fraction` of heads with the lowest scores


def estimate_unstable_heads_from_prompt(
    queries: Sequence[torch.Tensor],
    keys: Sequence[torch.Tensor],
    token_budget: int,
    page_size: int = 16,
    fraction: float = DEFAULT_UNSTABLE_FRACTION,
    max_distance: int = 16,
    group_reduce: GroupReduce = "max",
) -> PromptEstimate:
    """Estimate every layer's head stability from the prompt, and per request the unstable ``fraction`` of heads.

    Args:
        queries: per layer ``[B, Hq, W, D]`` queries of the last ``W`` prompt positions (``W`` about 64).
        keys: per layer ``[B, H, T, D]`` keys of the whole prompt.
    Heads with an undefined (``nan``) score count as stable.
    """
    scores = torch.stack([
        prompt_stability(query, key, token_budget, page_size, max_distance, group_reduce)
        for query, key in zip(queries, keys, strict=True)
    ])  # [L, B, H]
    num_layers, batch, heads = scores.shape
    flat = scores.permute(1, 0, 2).reshape(batch, -1).nan_to_num(nan=float("inf"))
    lowest = flat.argsort(dim=1, stable=True)[:, : lowest_count(flat.shape[1], fraction)]
    unstable = torch.zeros_like(flat, dtype=torch.bool).scatter_(1, lowest, True)
    return PromptEstimate(scores, unstable.view(batch, num_layers, heads).permute(1, 0, 2))


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation of two equally shaped tensors (ties broken by position)."""
    ranks = [x.flatten().argsort(stable=True).argsort().to(torch.float64) for x in (a, b)]
    ranks = [r - r.mean() for r in ranks]
    return float((ranks[0] * ranks[1]).sum() / (ranks[0].norm() * ranks[1].norm()))


def online_agreement(estimates: torch.Tensor, profile: HeadProfile) -> dict[str, Any]:
    """How well prompt estimates ``[N, L, H]`` (``N`` requests; ``L``: the layers the profile covers, see
    :meth:`HeadProfile.covered_layers`) recover an offline profile's unstable heads.

    Each estimate's unstable set has as many heads as the profile's (lowest estimated scores). Returns the mean
    per-request overlap ``|estimated ∩ profile| / |profile|``, the overlap of the set from the mean estimate, the
    Spearman correlation of the mean estimate with the profile scores (when the profile has scores) and the overlap
    expected by chance.
    """
    covered = profile.covered_layers()
    reference = profile.unstable_mask()[covered]
    size = int(reference.sum())
    if estimates.shape[1:] != reference.shape:
        raise ValueError(f"estimates {tuple(estimates.shape)} do not match the profile shape {tuple(reference.shape)}")
    if size == 0:
        raise ValueError("The profile has no unstable heads to compare with.")

    def overlap(scores: torch.Tensor) -> float:
        lowest = scores.flatten().nan_to_num(nan=float("inf")).argsort(stable=True)[:size]
        return float(reference.flatten()[lowest].sum()) / size

    mean_estimate = estimates.nanmean(dim=0)
    result: dict[str, Any] = {
        "per_request_overlap": sum(overlap(sample) for sample in estimates) / estimates.shape[0],
        "mean_estimate_overlap": overlap(mean_estimate),
        "random_baseline": size / reference.numel(),
        "requests": int(estimates.shape[0]),
    }
    if profile.scores is not None:
        result["spearman_vs_profile_scores"] = _spearman(
            mean_estimate.nan_to_num(nan=float("inf")), profile.score_matrix()[covered]
        )
    return result
