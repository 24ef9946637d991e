"""Pages per row split across each request's KV heads at the prompt (``head_budgets="prompt"``, beyond the paper).

With ``head_budgets="uniform"`` every (request, KV head) row attends to ``K`` pages. With ``"prompt"`` a layer's
``H * K`` pages of a request are split across its heads once, from the first prompt chunk, and kept for the whole
decode (fixed shapes): a head whose attention is spread over many pages takes pages from one whose attention sits on
a few. The split maximises the attention mass that each head's top ``K_h`` pages (by true attention) hold for the
prompt's last :data:`~flexicache.config.PROMPT_TAIL_QUERIES` queries, summed over the heads: with ``gain[h, k]`` the
mean mass of head ``h``'s ``k``-th heaviest page, non-increasing in ``k``, the best split takes the largest gains over
all heads (:func:`split_budget`).

Each request is split over its own real tokens (a padded batch prefilled in one chunk decodes as each request
alone). A head's share stays within :func:`row_bounds`: at least the sink and the tail page, at most what it chooses
from: an unstable head's candidates (``exact_candidates * K``), a stable head's working set and tail (``K + C``);
without standby pages a stable head keeps ``K``. The split reads the first prompt chunk only: after a chunked
prefill it comes from the first chunk (a request whose first chunk holds no more than ``K`` pages keeps ``K``, and a
left-padded request's first chunk holds fewer of its tokens than alone), and later prompts of a conversation keep it.
The gains use the softmax scale ``head_dim ** -0.5`` (that of the models measured here).
"""

from __future__ import annotations

import torch

from flexicache.config import FlexiCacheConfig
from flexicache.profiling.pages import QUERY_BLOCK


def prompt_page_gains(tail_mass: list[torch.Tensor], num_pages: int) -> torch.Tensor:
    """``[B, H, P]`` float32: ``gain[b, h, k]``, the mean over request ``b``'s last real prompt positions of the
    attention mass of head ``h``'s ``k``-th heaviest page of that request's real tokens (``-inf`` beyond its pages).

    Args:
        tail_mass: per request ``[H, W_b, P_b]``, :func:`~flexicache.profiling.pages.tail_page_mass` of the chunk.
        num_pages: ``P = ceil(T / page_size)``, the chunk's pages.
    """
    batch, num_heads = len(tail_mass), tail_mass[0].shape[0]
    gains = torch.full((batch, num_heads, num_pages), float("-inf"), dtype=torch.float32, device=tail_mass[0].device)
    for request, mass in enumerate(tail_mass):
        window, pages = mass.shape[1:]
        if window == 0:
            continue
        ranked = mass.sort(dim=-1, descending=True).values  # [H, W, P_b]
        total = torch.zeros(num_heads, pages, dtype=torch.float32, device=mass.device)
        for start in range(0, window, QUERY_BLOCK):  # block by block: the summation order of eval/results' runs
            total += ranked[:, start:start + QUERY_BLOCK].sum(dim=1)
        gains[request, :, :pages] = total / window
    return gains


def split_budget(gains: torch.Tensor, total: int, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """``[H]`` long: pages per head, ``low <= K_h <= high`` and summing to ``total``, that maximise the summed gains
    of the pages given (``gains [H, P]``, each row non-increasing: head ``h``'s ``k``-th page gains ``gains[h, k]``;
    a page beyond ``P`` gains ``-inf``, taken only where the bounds demand it). Equal gains go to the lower head, then
    the lower page.

    Raises ``ValueError`` when the bounds cannot meet ``total``.
    """
    num_heads, width = gains.shape
    low, high = low.long().cpu(), high.long().cpu()
    if int(low.sum()) > total or int(high.sum()) < total:
        raise ValueError(f"cannot split {total} pages over heads holding {low.tolist()} to {high.tolist()} pages.")
    extra = total - int(low.sum())
    depth = int((high - low).max()) if num_heads else 0
    columns = low.view(-1, 1) + torch.arange(depth).view(1, -1)  # [H, depth] the page each extra unit would be
    # A page beyond P ranks below every real page (gains >= 0), a unit beyond a head's bound below everything.
    beyond_pages = gains.float().cpu().nan_to_num(neginf=-1.0)
    padded = torch.nn.functional.pad(beyond_pages, (0, max(0, int(high.max()) - width)), value=-1.0)
    candidate = padded.gather(1, columns.clamp(max=padded.shape[1] - 1))
    candidate = candidate.masked_fill(columns >= high.view(-1, 1), float("-inf"))
    # Stable descending order over (head, page) keeps ties toward the lower head, then the lower page; with every
    # row non-increasing, a head's taken units are its first ones.
    order = candidate.flatten().sort(descending=True, stable=True).indices[:extra]
    taken = torch.zeros(num_heads * depth, dtype=torch.long).scatter_(0, order, 1).view(num_heads, depth)
    return low + taken.sum(dim=1)


def row_bounds(settings: FlexiCacheConfig, unstable: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(low, high)``, ``[H]`` each: the pages a head may attend to under ``head_budgets="prompt"``, for the heads
    marked in ``unstable [H]`` (bool) and the others (stable; without standby pages these keep ``K``)."""
    k, standby = settings.pages_per_head, settings.num_standby_pages
    low = torch.full(unstable.shape, 2, dtype=torch.long)
    high = torch.where(unstable, settings.candidate_pages, k + standby)
    if not standby:
        low = torch.where(unstable, low, k)
    return low, high


def prompt_row_pages(gains: torch.Tensor, settings: FlexiCacheConfig, unstable_heads: list[int]) -> torch.Tensor:
    """``[B, H]`` long (CPU): each request's split of its ``H * K`` pages from ``gains [B, H, P]``
    (:func:`prompt_page_gains`); ``K`` everywhere for a request whose prompt has no more pages than ``K``."""
    batch, num_heads, _ = gains.shape
    k = settings.pages_per_head
    unstable = torch.zeros(num_heads, dtype=torch.bool)
    unstable[unstable_heads] = True
    low, high = row_bounds(settings, unstable)
    pages = torch.full((batch, num_heads), k, dtype=torch.long)
    gains = gains.cpu()
    for request in range(batch):
        if int(gains[request].isfinite().sum(dim=1).max()) > k:
            pages[request] = split_budget(gains[request], num_heads * k, low, high)
    return pages
