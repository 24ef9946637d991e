"""Token selections compared by :func:`~flexicache.diagnostics.recall.evaluate`: FlexiCache's page scores, the same
refined by the true mass of more candidates, the oracle pages (top-K by true attention mass) and the oracle tokens.

Every selector returns ``[R, T]`` bool for a :class:`~flexicache.diagnostics.recall.StepView`; page selectors choose
``budget // page_size`` pages per row with the first (sink) and the last (tail) page always in, as the cache does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


def box_pages(view: StepView, settings: FlexiCacheConfig, k: int) -> torch.Tensor:
    """``[R, k]`` each row's top-``k`` pages by FlexiCache's box scores with ``settings``, sink and tail forced, in
    ascending order (:func:`~flexicache.selection.select_pages`)."""
    keys, query = view.keys, view.query
    if settings.principal_bounds:
        basis = KeyBasis.principal_axes(keys[:, : max(view.prompt_tokens, 1)].unsqueeze(0), None)
        keys, query = basis.chunk(keys.unsqueeze(0))[0], basis.rows(query)
    kmin, kmax = page_bounds(keys, settings.page_size)
    scores = quest_page_scores(query, kmin, kmax, settings.group_reduce, settings.spread_weight)
    counts = torch.full((scores.shape[0],), scores.shape[1], dtype=torch.long)
    return select_pages(scores, counts, k, force_last=True)[0]


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
        mass = view.weights.sum(1)
        num_pages = -(-view.num_tokens // page_size)
        page_mass = F.pad(mass, (0, num_pages * page_size - view.num_tokens)).view(-1, num_pages, page_size).sum(-1)
        ranked = page_mass.gather(1, pool)  # every row has all pages: no -1 padding in the pool
        ranked[:, 0] = ranked[:, -1] = float("inf")  # the sink and the tail: the pool's first and last pages
        kept = pool.gather(1, ranked.topk(min(k, pool.shape[1]), dim=1).indices)
        return pages_to_tokens(kept, page_size, view.num_tokens)

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
