"""``exact_rescore`` in Triton: the pages a head attends to chosen by their keys' attention mass, inside the fused
decode table (CUDA-graph capturable, like :mod:`flexicache.backends.triton_select`).

Two launches per layer and step between the table's box scoring and its page list:

- ``_candidates_kernel`` (grid: unstable row): list the pool slots and token counts of the row's top
  ``exact_candidates * K`` pages by box score (sink and tail among them: their scores are ``+inf``) in ascending page
  order (none where every row lists every page);
- ``_page_mass_kernel`` (grid: row x block of listed pages): each query head's log2 attention mass of every listed
  page (``log2 sum_t 2^(q . k_t * scale * log2(e))``) from the pool's keys: an unstable row's candidates, a stable
  row's working set (``K - 1 + C`` slots, with standby pages).

The table kernel turns the masses into each page's share of the listed pages' attention summed over the GQA group
(:func:`~flexicache.selection.exact_page_scores`) and selects by it: an unstable row its ``K`` (its own ``k`` with
``head_budgets="prompt"``) best candidates, sink and tail forced (:func:`~flexicache.selection.select_candidates`), a
stable row its ``K - 1`` best working-set slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flexicache.backends.triton_select import (
    ExactScratch,
    TableInputs,
    _order_key,
    _top_keys,
    list_pages,
    score_unstable_pages,
)

MASS_TOKENS = 64  # keys per program of the page-mass kernel


@dataclass
class ExactInputs:
    """What the exact rescoring reads: ``query`` ``[B * H, G, D]`` the rows' queries in the keys' own axes,
    ``pool_k`` ``[slots, ps, D]`` the device pool's keys, the attention's softmax ``scale`` and the layer's
    :class:`~flexicache.backends.triton_select.ExactScratch`."""

    query: torch.Tensor
    pool_k: torch.Tensor
    scale: float
    scratch: ExactScratch


def exact_decode_table(inputs: TableInputs, exact: ExactInputs, scores: torch.Tensor, working_scores: torch.Tensor,
                       flat: torch.Tensor | None = None, indptr: torch.Tensor | None = None,
                       table_out: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """:func:`~flexicache.backends.triton_select.decode_table` with the pages chosen by their exact attention mass
    (same outputs; ``scores``/``working_scores``: its scratch)."""
    score_unstable_pages(inputs, scores)
    page_masses(inputs, exact, scores)
    list_pages(inputs, scores, working_scores, flat, indptr, table_out, exact=exact.scratch)


def page_masses(inputs: TableInputs, exact: ExactInputs, scores: torch.Tensor) -> None:
    """Fill the scratch's candidates (the unstable rows' top ``exact_candidates * K`` by box ``scores [B * hu, >= P]``;
    none for rows within the budget) and the log2 attention masses of those and of the stable rows' working sets
    (with standby pages)."""
    scratch = exact.scratch
    batch = inputs.num_tokens.shape[0]
    num_heads = exact.query.shape[0] // batch
    log2_scale = exact.scale * math.log2(math.e)
    num_unstable, candidates = inputs.unstable_heads.numel(), inputs.candidate_pages
    if num_unstable:
        block_scores = triton.next_power_of_2(max(inputs.kmin.shape[2], 16))
        _candidates_kernel[(batch * num_unstable,)](
            scores, inputs.table, inputs.num_tokens, scratch.candidate_slots, scratch.candidate_lens, num_unstable,
            inputs.table.shape[2], scores.shape[1], inputs.fewest_pages, CANDIDATES=candidates,
            PAGE_SIZE=inputs.page_size, BLOCK_C=triton.next_power_of_2(candidates), BLOCK_S=block_scores,
            num_warps=max(4, min(16, block_scores // 256)),
        )
        _page_mass(inputs, exact, scratch.candidate_slots, scratch.unstable_mass, inputs.unstable_heads, num_heads,
                   log2_scale, stable=False)
    standby = inputs.stable_heads.numel() and inputs.selected.shape[1] > inputs.pages_per_head - 1
    if standby:  # standby pages: ranked at every step
        _page_mass(inputs, exact, inputs.selected, scratch.stable_mass, inputs.stable_heads, num_heads, log2_scale,
                   stable=True)


def _page_mass(inputs: TableInputs, exact: ExactInputs, pages: torch.Tensor, mass: torch.Tensor,
               heads: torch.Tensor, num_heads: int, log2_scale: float, stable: bool) -> None:
    """Launch ``_page_mass_kernel`` over the rows of ``heads`` and their ``W`` listed pages: the stable rows' working
    sets (``pages``: ``selected [rows, W]``), or the unstable rows' candidates (``pages``: their slots, read for
    ``W`` only)."""
    group, head_dim = exact.query.shape[1:]
    count, block_pages = pages.shape[1], max(1, MASS_TOKENS // inputs.page_size)
    _page_mass_kernel[(inputs.num_tokens.shape[0] * heads.numel(), triton.cdiv(count, block_pages))](
        exact.query, exact.pool_k, pages, exact.scratch.candidate_slots, exact.scratch.candidate_lens, heads, mass,
        heads.numel(), num_heads, inputs.stable_base, log2_scale, COUNT=count, PAGE_SIZE=inputs.page_size,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_W=block_pages, STABLE=stable,
    )


@triton.jit(do_not_specialize=["num_unstable", "table_capacity", "scores_stride", "within_pages"])
def _candidates_kernel(scores_ptr, table_ptr, num_tokens_ptr, slots_ptr, lens_ptr, num_unstable,
                       table_capacity, scores_stride, within_pages, CANDIDATES: tl.constexpr, PAGE_SIZE: tl.constexpr,
                       BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    index = tl.program_id(0)  # unstable row b * hu + i
    n = tl.load(num_tokens_ptr + index // num_unstable).to(tl.int32)
    num_pages = (n + PAGE_SIZE - 1) // PAGE_SIZE
    last_len = n - (num_pages - 1) * PAGE_SIZE
    c = tl.arange(0, BLOCK_C)
    out = index.to(tl.int64) * CANDIDATES + c
    tl.store(slots_ptr + out, tl.full([BLOCK_C], -1, tl.int64), mask=c < CANDIDATES)
    tl.store(lens_ptr + out, tl.zeros([BLOCK_C], tl.int64), mask=c < CANDIDATES)
    tl.debug_barrier()
    if num_pages > within_pages:  # rows within every row's budget list every page, unscored
        page = tl.arange(0, BLOCK_S)
        valid = page < num_pages
        chosen = valid
        if num_pages > CANDIDATES:
            key = _order_key(tl.load(scores_ptr + index.to(tl.int64) * scores_stride + page, mask=valid,
                                     other=0.0)).to(tl.int64)
            chosen = _top_keys(key, valid, CANDIDATES)
        position = index.to(tl.int64) * CANDIDATES + tl.cumsum(chosen.to(tl.int32), axis=0) - 1
        slot = tl.load(table_ptr + index.to(tl.int64) * table_capacity + page, mask=chosen, other=-1)
        tl.store(slots_ptr + position, slot.to(tl.int64), mask=chosen)
        length = tl.where(page == num_pages - 1, last_len, PAGE_SIZE)
        tl.store(lens_ptr + position, length.to(tl.int64), mask=chosen)


@triton.jit(do_not_specialize=["num_listed", "num_heads", "stable_base", "log2_scale"])
def _page_mass_kernel(query_ptr, pool_k_ptr, pages_ptr, slots_ptr, lens_ptr, heads_ptr, mass_ptr, num_listed,
                      num_heads, stable_base, log2_scale, COUNT: tl.constexpr, PAGE_SIZE: tl.constexpr,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_W: tl.constexpr, STABLE: tl.constexpr):
    """Program ``(b * n + i, block)``: the log2 attention mass ``[GROUP, BLOCK_W]`` of a block of listed pages of
    row (request ``b``, head ``heads[i]``) into ``mass [rows, GROUP, COUNT]`` (``-inf`` for a page without
    tokens). A stable row's pages sit at its working-set slots (full where ``pages >= 0``); an unstable row's at
    ``slots`` with ``lens`` tokens."""
    index = tl.program_id(0)
    row = (index // num_listed) * num_heads + tl.load(heads_ptr + index % num_listed)
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    in_list = w < COUNT
    listed = index.to(tl.int64) * COUNT + w
    if STABLE:
        page = tl.load(pages_ptr + listed, mask=in_list, other=-1)
        slot = stable_base + index.to(tl.int64) * (COUNT + 1) + w
        length = tl.where(page >= 0, PAGE_SIZE, 0)
    else:
        slot = tl.load(slots_ptr + listed, mask=in_list, other=-1)
        length = tl.load(lens_ptr + listed, mask=in_list, other=0)
    if tl.max(length, axis=0) > 0:
        t = tl.arange(0, PAGE_SIZE)
        dims = tl.arange(0, HEAD_DIM)
        real = t[None, :] < length[:, None]  # [BLOCK_W, PAGE_SIZE]
        token = tl.maximum(slot, 0).to(tl.int64)[:, None] * PAGE_SIZE + t[None, :]
        keys = tl.load(pool_k_ptr + token[:, :, None] * HEAD_DIM + dims[None, None, :], mask=real[:, :, None],
                       other=0.0).to(tl.float32)
        for g in tl.static_range(GROUP):
            q = tl.load(query_ptr + (row.to(tl.int64) * GROUP + g) * HEAD_DIM + dims).to(tl.float32) * log2_scale
            logits = tl.where(real, tl.sum(keys * q[None, None, :], axis=2), float("-inf"))
            top = tl.max(logits, axis=1)
            top = tl.where(top == float("-inf"), 0.0, top)
            mass = top + tl.log2(tl.sum(tl.exp2(logits - top[:, None]), axis=1))  # a page without tokens: -inf
            tl.store(mass_ptr + (index.to(tl.int64) * GROUP + g) * COUNT + w, mass, mask=in_list)
    else:
        for g in tl.static_range(GROUP):
            tl.store(mass_ptr + (index.to(tl.int64) * GROUP + g) * COUNT + w,
                     tl.full([BLOCK_W], float("-inf"), tl.float32), mask=in_list)
