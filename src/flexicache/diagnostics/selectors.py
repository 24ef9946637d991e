"""Token selections compared by :func:`~flexicache.diagnostics.recall.evaluate`: FlexiCache's page scores, the
oracle pages (top-K by true attention mass) and the oracle tokens.

Every selector returns ``[R, T]`` bool for a :class:`~flexicache.diagnostics.recall.StepView`; page selectors choose
``budget // page_size`` pages per row with the first (sink) and the last (tail) page always in, as the cache does.
"""

from __future__ import annotations

import torch

from flexicache.config import FlexiCacheConfig
from flexicache.diagnostics.recall import Selector, StepView
from flexicache.key_basis import KeyBasis
from flexicache.oracle import oracle_token_mask
from flexicache.profiling.pages import page_bounds
from flexicache.selection import quest_page_scores, select_pages


def pages_to_tokens(pages: torch.Tensor, page_size: int, num_tokens: int) -> torch.Tensor:
    """``pages [R, k]`` (``-1`` = none) -> ``[R, T]`` bool mask of their tokens."""
    num_pages = -(-num_tokens // page_size)
    chosen = torch.zeros(pages.shape[0], num_pages + 1, dtype=torch.bool, device=pages.device)
    chosen.scatter_(1, pages.masked_fill(pages < 0, num_pages), True)
    return chosen[:, :num_pages].repeat_interleave(page_size, dim=1)[:, :num_tokens]


def flexicache(settings: FlexiCacheConfig) -> Selector:
    """FlexiCache's selection with ``settings`` (page size, budget, group reduction, spread weight, principal axes
    of the prompt's keys), scored afresh at every step: each row's top pages by its box scores, sink and tail
    forced."""

    def select(view: StepView) -> torch.Tensor:
        keys, query = view.keys, view.query
        if settings.principal_bounds:
            basis = KeyBasis.principal_axes(keys[:, : max(view.prompt_tokens, 1)].unsqueeze(0), None)
            keys, query = basis.chunk(keys.unsqueeze(0))[0], basis.rows(query)
        kmin, kmax = page_bounds(keys, settings.page_size)
        scores = quest_page_scores(query, kmin, kmax, settings.group_reduce, settings.spread_weight)
        counts = torch.full((scores.shape[0],), scores.shape[1], dtype=torch.long)
        pages, _ = select_pages(scores, counts, settings.pages_per_head, force_last=True)
        return pages_to_tokens(pages, settings.page_size, view.num_tokens)

    return select


def oracle_pages(budget: int, page_size: int = 16) -> Selector:
    """The ceiling of page-granular top-K: pages ranked by true attention mass summed over the group
    (:func:`~flexicache.oracle.oracle_token_mask`, what :class:`~flexicache.oracle.OracleCache` attends to)."""

    def select(view: StepView) -> torch.Tensor:
        return oracle_token_mask(view.weights, page_size, budget // page_size)

    return select


def oracle_tokens(budget: int) -> Selector:
    """The ceiling of any sparse selection of ``budget`` tokens: the top tokens by true mass over the group."""

    def select(view: StepView) -> torch.Tensor:
        mass = view.weights.sum(1)
        top = mass.topk(min(budget, view.num_tokens), dim=1).indices
        return torch.zeros_like(mass, dtype=torch.bool).scatter_(1, top, True)

    return select
