"""Random-corrected overlap (RCO) of top-K page sets and the stable / unstable head classification.

A page set is a ``[..., K]`` integer tensor of distinct page indices with ``-1`` padding (the layout of
:func:`flexicache.selection.select_pages`). For sets ``S_t`` and ``S_t+d`` over ``N`` candidate pages::

    RCO = (|S_t ∩ S_t+d| / K - K / N) / (1 - K / N)

It is 1 for identical sets and 0 in expectation for independent uniformly random sets. ``N`` is the page count at
the later step (the expected overlap of a random ``K``-subset of ``N`` pages with any ``K``-set is ``K^2 / N``);
pairs whose earlier step has ``N <= K`` pages are undefined (every page is selected) and skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flexicache.config import DEFAULT_UNSTABLE_FRACTION

PAIR_CHUNK_ENTRIES = 2**24  # page entries :func:`rco_by_distance` looks up at once (bounds its transient memory)


def overlap_counts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``|a ∩ b|`` of page sets ``a [..., Ka]``, ``b [..., Kb]`` (distinct entries, ``-1`` padding; leading dims
    broadcast) -> ``[...]`` int64: each entry of ``a`` looked up in ``b`` sorted (``K log K`` per set, not ``K x K``
    comparisons)."""
    leading = torch.broadcast_shapes(a.shape[:-1], b.shape[:-1])
    a, b = a.expand(*leading, a.shape[-1]), b.expand(*leading, b.shape[-1])
    return _count_in_sorted(a, _sorted_sets(b))


def _sorted_sets(sets: torch.Tensor) -> torch.Tensor:
    """Page sets ``[..., K]`` sorted ascending, the ``-1`` padding moved last (as the largest value)."""
    return sets.masked_fill(sets < 0, torch.iinfo(sets.dtype).max).sort(dim=-1).values.contiguous()


def _count_in_sorted(a: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """``|a ∩ present|`` ``[...]`` of sets ``a [..., Ka]`` and sets ``present [..., Kb]`` from :func:`_sorted_sets`
    (the same leading dims)."""
    if a.shape[-1] == 0 or present.shape[-1] == 0:
        return torch.zeros(a.shape[:-1], dtype=torch.long, device=a.device)
    position = torch.searchsorted(present, a.contiguous()).clamp(max=present.shape[-1] - 1)
    return ((present.gather(-1, position) == a) & (a >= 0)).sum(dim=-1)


def _rco_of_counts(counts: torch.Tensor, k: int, num_pages: torch.Tensor | int) -> torch.Tensor:
    """RCO (float64, ``nan`` where ``num_pages <= k``) of overlap ``counts`` of ``k``-sets over ``num_pages``."""
    n = torch.as_tensor(num_pages, dtype=torch.float64, device=counts.device)
    chance = k / n
    rco = (counts.to(torch.float64) / k - chance) / (1.0 - chance)
    return torch.where(n > k, rco, torch.full_like(rco, float("nan")))


def random_corrected_overlap(
    a: torch.Tensor, b: torch.Tensor, k: int, num_pages: torch.Tensor | int
) -> torch.Tensor:
    """RCO of page sets ``a``, ``b`` ``[..., K]`` with ``num_pages`` (broadcastable to ``[...]``) candidates.

    Returns float64 ``[...]``; ``nan`` where ``num_pages <= k``.
    """
    return _rco_of_counts(overlap_counts(a, b), k, num_pages)


def rco_by_distance(
    pages: torch.Tensor, num_pages: torch.Tensor, k: int, max_distance: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean RCO between the sets of steps ``t`` and ``t + d`` for ``d = 1 .. max_distance``.

    Every valid step pair of every distance is counted in one batch of lookups (in chunks of
    :data:`PAIR_CHUNK_ENTRIES` page entries), each step's set sorted once: a handful of kernels and no device sync
    whatever the distance count (the prompt's head split runs this per layer inside the prefill).

    Args:
        pages: ``[S, *heads, K]`` page sets of ``S`` consecutive decode steps (any device: the curve is on it).
        num_pages: ``[S]`` candidate pages at each step.

    Returns:
        ``(curve [max_distance, *heads], pairs [max_distance])``: mean RCO over the valid step pairs (``nan`` where
        there is none) and the number of valid pairs at each distance.
    """
    steps, head_shape, device = pages.shape[0], pages.shape[1:-1], pages.device
    curve = torch.full((max_distance, *head_shape), float("nan"), dtype=torch.float64, device=device)
    pairs = torch.zeros(max_distance, dtype=torch.long)
    num_pages = num_pages.to(device="cpu", dtype=torch.long)
    distances = range(1, min(max_distance, steps - 1) + 1)
    earlier = [(num_pages[:-d] > k).nonzero().view(-1) for d in distances]  # valid pairs: N > K at the earlier step
    if not any(starts.numel() for starts in earlier):
        return curve, pairs
    pairs[: len(earlier)] = torch.tensor([starts.numel() for starts in earlier])
    first = torch.cat(earlier)  # [P] earlier step of each pair, grouped by distance
    second = first + torch.repeat_interleave(torch.tensor(list(distances)), pairs[: len(earlier)])
    present = _sorted_sets(pages)
    first_on_device, second_on_device = first.to(device), second.to(device)
    chunk = max(1, PAIR_CHUNK_ENTRIES // max(1, pages[0].numel()))
    counts = torch.cat([_count_in_sorted(pages[first_on_device[start:start + chunk]],
                                         present[second_on_device[start:start + chunk]])
                        for start in range(0, first.numel(), chunk)])  # [P, *heads]
    rco = _rco_of_counts(counts, k, num_pages[second].to(device).view(-1, *([1] * len(head_shape))))
    for d, (end, count) in enumerate(zip(pairs.cumsum(0).tolist(), pairs.tolist(), strict=True)):
        if count:
            curve[d] = rco[end - count:end].mean(dim=0)
    return curve, pairs


def stability_score(curve: torch.Tensor) -> torch.Tensor:
    """Stability score ``[*heads]`` from an RCO curve ``[D, *heads]``: the mean over distances with data."""
    if torch.isnan(curve).all(dim=0).any():
        raise ValueError(
            "No decode step had more pages than the token budget selects (N <= K everywhere): use longer prompts "
            "or a smaller --budget."
        )
    return curve.nanmean(dim=0)


def lowest_count(total: int, fraction: float) -> int:
    """``round(fraction * total)`` with halves rounded up, clamped to ``[0, total]``."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    return min(total, int(fraction * total + 0.5))


def bottom_quantile_mask(sample_scores: torch.Tensor, quantile: float = 0.25) -> torch.Tensor:
    """Per sample, the ``quantile`` of heads with the lowest score: ``[N, L, H]`` scores -> ``[N, L, H]`` bool.

    Equal scores are ordered by head position (layer-major) so the result is deterministic.
    """
    num_samples = sample_scores.shape[0]
    flat = sample_scores.reshape(num_samples, -1)
    count = lowest_count(flat.shape[1], quantile)
    order = flat.argsort(dim=1, stable=True)[:, :count]
    mask = torch.zeros_like(flat, dtype=torch.bool)
    mask.scatter_(1, order, True)
    return mask.view_as(sample_scores)


@dataclass
class Classification:
    """Unstable heads and the statistics they were chosen by."""

    scores: torch.Tensor  # [L, H] mean stability score over samples
    bottom_counts: torch.Tensor  # [L, H] samples in which the head was in the bottom quantile
    unstable: list[tuple[int, int]]  # (layer, head), most unstable first

    def unstable_mask(self) -> torch.Tensor:
        """``[L, H]`` bool, True for unstable heads."""
        mask = torch.zeros(self.scores.shape, dtype=torch.bool)
        for layer, head in self.unstable:
            mask[layer, head] = True
        return mask


def classify_heads(sample_scores: torch.Tensor, fraction: float = DEFAULT_UNSTABLE_FRACTION, quantile: float = 0.25
                   ) -> Classification:
    """The ``fraction`` of heads most often in a sample's bottom ``quantile``; ties go to the lower mean score.

    Args:
        sample_scores: ``[N, L, H]`` stability score of every head in each of ``N`` samples.
    """
    if sample_scores.ndim != 3 or sample_scores.shape[0] == 0:
        raise ValueError(f"sample_scores must be [N >= 1, L, H], got {tuple(sample_scores.shape)}")
    scores = sample_scores.mean(dim=0)
    counts = bottom_quantile_mask(sample_scores, quantile).sum(dim=0)
    num_heads = scores.shape[1]
    flat_counts, flat_scores = counts.flatten(), scores.flatten()
    by_score = flat_scores.argsort(stable=True)
    order = by_score[(-flat_counts[by_score]).argsort(stable=True)]  # count descending, then score ascending
    chosen = order[: lowest_count(flat_scores.numel(), fraction)].tolist()
    unstable = [(index // num_heads, index % num_heads) for index in chosen]
    return Classification(scores=scores, bottom_counts=counts, unstable=unstable)
