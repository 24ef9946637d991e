"""What a head loses as a stable head rather than an unstable one, estimated from the prompt tail (beyond the paper).

The online head split (:mod:`flexicache.head_split`, ``split_score="staleness"``, the default) makes unstable the
heads that gain most from it. Every query position of the prompt tail is treated like a decode step over the full
pages that exist at it (the page being written is attended either way and left out), and its true attention mass
(each query head's softmax share, averaged over the GQA group) is compared, page by page, with three selections of
``K - 1`` pages (``K``: the pages a head attends to, the tail page included):

- the *oracle*: the ``K - 1`` pages of most true mass;
- an *unstable* head's: the ``K - 1`` of most mass among its ``exact_candidates * K`` pages of best box score for
  that query (what exact rescoring chooses from);
- a *stable* head's, ``d = 0 .. horizon - 1`` steps after a rerank: the ``K - 1`` of most mass among the working set
  that rerank took (its ``K - 1 + C`` pages of best box score for the rerank's query) and the pages filled since
  (retired tails stay on the device until the next rerank).

A selection's *loss* is the oracle's mass less its own. A head's gain from being unstable is its mean stable loss
(every rerank position of the tail, every step after it) less its mean unstable loss: the attention mass that a
working set gone stale misses and a fresh choice would hold. Gains are in units of attention mass, so the heads of
all layers are ranked together. On SmolLM2-135M at 1/8 of the context this split gave decode-mode perplexity 1.013
and 1.021 of dense on two pairs of files, against 1.023 and 1.018 with the page-overlap score
(:func:`~flexicache.profiling.online.prompt_stability`, the paper's RCO measure; eval/RESULTS.md).

Box scores here are in the model's axes (the cache scores in its prompt keys' principal axes): an estimate of the
ranking, not the cache's exact selection.
"""

from __future__ import annotations

import torch

from flexicache.profiling.pages import page_bounds
from flexicache.selection import GroupReduce, box_scores, reduce_group


def prompt_staleness_gain(
    query: torch.Tensor,
    key: torch.Tensor,
    mass: torch.Tensor,
    pages_per_head: int,
    standby_pages: int,
    candidate_pages: int,
    page_size: int,
    horizon: int = 16,
    every: int = 2,
    group_reduce: GroupReduce = "max",
    spread_weight: float = 1.0,
) -> torch.Tensor:
    """``[B, H]`` float32: each head's gain from being unstable (see the module docstring); ``nan`` where the prompt
    has too few full pages (no more than ``K - 1`` at its last position) to lose any.

    Args:
        query: ``[B, Hq, W, D]`` queries of the last ``W`` prompt positions (RoPE applied; ``W <= T``).
        key: ``[B, H, T, D]`` keys of the whole prompt, pages starting at position 0 (no padding).
        mass: ``[B, H, W, P]`` those queries' attention mass per page
            (:func:`~flexicache.profiling.pages.tail_page_mass`).
        pages_per_head: ``K``, the pages a head attends to (the tail page included).
        standby_pages: ``C``, a stable head's pages on the device beyond ``K``.
        candidate_pages: an unstable head's candidates by box score (``exact_candidates * K``).
        horizon: decode steps a working set serves (the rerank interval).
        every: tail positions between two rerank positions averaged over.
        group_reduce, spread_weight: how pages are scored (:func:`~flexicache.selection.quest_page_scores`).
    """
    batch, num_heads, length, _ = key.shape
    window = query.shape[2]
    num_pages = -(-length // page_size)
    if mass.shape != (batch, num_heads, window, num_pages):
        raise ValueError(f"mass must be [B, H, W, P] = {[batch, num_heads, window, num_pages]} for these queries and "
                         f"keys, got {list(mass.shape)}")
    k = pages_per_head - 1
    if (length - 1) // page_size <= k:
        return torch.full((batch, num_heads), float("nan"), device=key.device)
    positions = torch.arange(length - window, length, device=key.device)
    full = positions // page_size  # [W] full pages at each tail position
    pages = torch.arange(num_pages, device=key.device)
    valid = pages < full.view(-1, 1)  # [W, P]
    horizon = max(1, min(horizon, window))
    starts = torch.arange(0, window - horizon + 1, every, device=key.device)  # [S] rerank positions
    steps = starts.view(-1, 1) + torch.arange(horizon, device=key.device)  # [S, h]
    # The pages filled since a rerank: full[start] + j for j < filled, held where below the step's full pages.
    filled = -(-horizon // page_size) + 1
    new_pages = full[starts].view(-1, 1, 1) + torch.arange(filled, device=key.device)  # [S, 1, F]
    new_held = new_pages < full[steps].unsqueeze(-1)  # [S, h, F]
    gains = []
    for request in range(batch):  # one request's fp32 copies at a time
        kmin, kmax = (bound.float() for bound in page_bounds(key[request], page_size))  # [H, P, D], exact
        request_mass = mass[request].float()  # [H, W, P]
        box = _tail_box_scores(query[request].float(), kmin, kmax, group_reduce, spread_weight)
        oracle = _top_mass(request_mass, valid, k)  # [H, W]
        candidates, candidate_valid = _top_pages(box, valid, candidate_pages)  # [H, W, min(candidate_pages, P)]
        unstable_loss = oracle - _top_mass(request_mass.gather(-1, candidates), candidate_valid, k)
        working_set, kept = _top_pages(box[:, starts], valid[starts], k + standby_pages)  # [H, S, min(K - 1 + C, P)]
        # each step's mass over its working set and the pages filled since: [H, S, h, min(K - 1 + C, P) + F]
        held_mass = torch.cat([_mass_at(request_mass, steps, working_set.unsqueeze(2)),
                               _mass_at(request_mass, steps, new_pages.clamp(max=num_pages - 1))], dim=-1)
        held_pages = torch.cat([kept.unsqueeze(2).expand(-1, -1, horizon, -1), new_held.expand(num_heads, -1, -1, -1)],
                               dim=-1)
        stable_loss = oracle[:, steps] - _top_mass(held_mass, held_pages, k)  # [H, S, h]
        gains.append(stable_loss.mean(dim=(1, 2)) - unstable_loss[:, steps].mean(dim=(1, 2)))
    return torch.stack(gains)


def _tail_box_scores(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, group_reduce: GroupReduce,
                     spread_weight: float) -> torch.Tensor:
    """``[H, W, P]`` box score of every page for each tail query (``query [Hq, W, D]``, boxes ``[H, P, D]``)."""
    num_heads, num_pages, head_dim = kmin.shape
    group, window = query.shape[0] // num_heads, query.shape[1]
    queries = query.view(num_heads, group, window, head_dim).transpose(1, 2).reshape(num_heads, window * group, -1)
    scores = box_scores(queries, kmin, kmax, spread_weight).view(num_heads * window, group, num_pages)
    return reduce_group(scores, group_reduce).view(num_heads, window, num_pages)


def _top_pages(score: torch.Tensor, valid: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``score [..., P]`` -> ``(pages, valid)``, each ``[..., min(count, P)]``: the ``count`` valid pages of best
    score (``valid`` broadcast to ``score``), the sink (page 0) always among them where valid, and whether each is
    valid (fewer valid pages than ``count`` leave invalid ones in the list)."""
    valid = valid.expand_as(score)
    ranked = score.masked_fill(~valid, float("-inf"))
    ranked[..., 0] = ranked[..., 0].masked_fill(valid[..., 0], float("inf"))
    pages = ranked.topk(min(count, score.shape[-1]), dim=-1).indices
    return pages, valid.gather(-1, pages)


def _mass_at(mass: torch.Tensor, steps: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """``[H, S, h, N]``: ``mass [H, W, P]`` at tail position ``steps [S, h]`` and the pages ``pages`` (long,
    ``[H, S, 1, N]`` or ``[S, h or 1, N]``, broadcast to the steps), without the ``[H, S, h, P]`` copy."""
    num_heads, _, num_pages = mass.shape
    index = steps.unsqueeze(-1) * num_pages + pages
    index = index.expand(num_heads, *index.shape[-3:])
    return mass.flatten(1).gather(1, index.flatten(1)).view(index.shape)


def _top_mass(mass: torch.Tensor, held: torch.Tensor, count: int) -> torch.Tensor:
    """``mass [..., P]`` -> ``[...]``: the summed mass of the ``count`` heaviest pages among those ``held``
    (bool, broadcast to ``mass``)."""
    return mass.masked_fill(~held, 0.0).topk(min(count, mass.shape[-1]), dim=-1).values.sum(dim=-1)
