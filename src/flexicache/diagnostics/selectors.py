"""Token selections compared by :func:`~flexicache.diagnostics.recall.evaluate`: FlexiCache's page scores, the same
refined by the true mass of more candidates, the oracle pages (top-K by true attention mass) and the oracle tokens.

Every selector returns ``[R, T]`` bool for a :class:`~flexicache.diagnostics.recall.StepView`; page selectors choose
``budget // page_size`` pages per row with the first (sink) and the last (tail) page always in, as the cache does.
"""

from __future__ import annotations

import torch

from flexicache.config import FlexiCacheConfig
from flexicache.diagnostics.recall import Selector, StepView
from flexicache.key_basis import KeyBasis
from flexicache.oracle import box_top_pages, oracle_token_mask, page_mask


def pages_to_tokens(pages: torch.Tensor, page_size: int, num_tokens: int) -> torch.Tensor:
    """``pages [R, k]`` (``-1`` = none) -> ``[R, T]`` bool mask of their tokens."""
    chosen = page_mask(pages, -(-num_tokens // page_size))
    return chosen.repeat_interleave(page_size, dim=1)[:, :num_tokens]


def box_pages(view: StepView, settings: FlexiCacheConfig, k: int) -> torch.Tensor:
    """``[R, k]`` each row's top-``k`` pages by FlexiCache's box scores with ``settings`` (in the principal axes of
    the prompt's keys with ``principal_bounds``), sink and tail forced, ascending."""
    keys, query = view.keys, view.query
    if settings.principal_bounds:
        basis = KeyBasis.principal_axes(keys[:, : max(view.prompt_tokens, 1)].unsqueeze(0), None)
        keys, query = basis.chunk(keys.unsqueeze(0))[0], basis.rows(query)
    return box_top_pages(query, keys, settings, k)


def flexicache(settings: FlexiCacheConfig) -> Selector:
    """FlexiCache's selection with ``settings`` (page size, budget, group reduction, spread weight, principal axes
    of the prompt's keys), scored afresh at every step: each row's top pages by its box scores, sink and tail
    forced."""

    def select(view: StepView) -> torch.Tensor:
        pages = box_pages(view, settings, settings.pages_per_head)
        return pages_to_tokens(pages, settings.page_size, view.num_tokens)

    return select


def refined(settings: FlexiCacheConfig, candidates: int = 2) -> Selector:
    """FlexiCache's box scores pick ``candidates`` x K pages, of which the K holding the most true attention mass
    (summed over the group) are kept, sink and tail forced: what scoring the candidates' keys exactly would select
    (a second stage that reads ``candidates`` x K pages of keys per step)."""
    if candidates < 1:
        raise ValueError(f"candidates must be >= 1 (pages scored exactly per page kept), got {candidates}")

    def select(view: StepView) -> torch.Tensor:
        k, page_size = settings.pages_per_head, settings.page_size
        pool = box_pages(view, settings, candidates * k)
        return oracle_token_mask(view.weights, page_size, k, page_mask(pool, -(-view.num_tokens // page_size)))

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
