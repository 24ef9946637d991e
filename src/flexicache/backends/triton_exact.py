"""``exact_rescore`` in Triton: the pages a head attends to chosen by their keys' attention mass, inside the fused
decode table (CUDA-graph capturable, like :mod:`flexicache.backends.triton_select`).

Three launches per layer and step between the table's scoring and its page list:

- ``_candidates_kernel`` (grid: unstable row): keep the row's top ``2K`` box scores (sink and tail among them:
  their scores are ``+inf``), set every other page's score to ``-inf`` and list the candidates' pages, pool slots
  and token counts in ascending page order;
- ``_page_mass_kernel`` (grid: row x block of listed pages): each query head's log attention mass of every listed
  page (``log2 sum_t exp2(q . k_t * scale * log2(e))``) from the pool's keys: an unstable row's candidates, a
  stable row's working set (``K - 1 + C`` slots);
- ``_page_shares_kernel`` (grid: row): the page's share of the listed pages' attention summed over the GQA group
  (:func:`~flexicache.selection.exact_page_scores`, in natural log): written over the candidates' box scores (sink
  and tail stay ``+inf``), or as the stable row's working-set scores.

The table kernel then selects as it does from box scores: the unstable rows' top ``K`` of the page-indexed scores
(:func:`~flexicache.selection.select_candidates` chooses the same pages in torch), the stable rows' ``K - 1`` best
working-set slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flexicache.backends.triton_select import (
    TableInputs,
    _order_key,
    _top_keys,
    list_pages,
    score_unstable_pages,
)

MASS_TOKENS = 64  # keys per program of the page-mass kernel


@dataclass
class ExactScratch:
    """A layer's scratch for the exact rescoring (kept by a captured CUDA graph): ``candidates`` /
    ``candidate_slots`` / ``candidate_lens``: ``[B * hu, 2K]`` int64; ``unstable_mass``: ``[B * hu, G, 2K]`` and
    ``stable_mass``: ``[B * hs, G, K - 1 + C]`` fp32 (one row where a class has no rows or, for the stable rows, no
    standby pages)."""

    candidates: torch.Tensor
    candidate_slots: torch.Tensor
    candidate_lens: torch.Tensor
    unstable_mass: torch.Tensor
    stable_mass: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.candidates, self.candidate_slots, self.candidate_lens, self.unstable_mass, self.stable_mass)

    def fits(self, inputs: TableInputs, group: int) -> bool:
        """Whether this scratch serves a table of ``inputs`` with ``group`` query heads per row."""
        unstable, stable = _scratch_shapes(inputs, group)
        return self.unstable_mass.shape == unstable and self.stable_mass.shape == stable


def exact_scratch(inputs: TableInputs, group: int) -> ExactScratch:
    """Fresh :class:`ExactScratch` for a table of ``inputs`` with ``group`` query heads per row."""
    unstable, stable = _scratch_shapes(inputs, group)
    device = inputs.num_tokens.device
    index = torch.full((unstable[0], unstable[2]), -1, dtype=torch.long, device=device)
    return ExactScratch(index, index.clone(), torch.zeros_like(index),
                        torch.empty(unstable, dtype=torch.float32, device=device),
                        torch.empty(stable, dtype=torch.float32, device=device))


def _scratch_shapes(inputs: TableInputs, group: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The shapes of the unstable and the stable rows' page masses (see :class:`ExactScratch`)."""
    unstable_rows = inputs.num_tokens.shape[0] * inputs.unstable_heads.numel()
    working = inputs.selected.shape[1] if inputs.selected is not None else 0
    stable_rows = inputs.selected.shape[0] if working > inputs.pages_per_head - 1 else 0
    return ((max(unstable_rows, 1), group, 2 * inputs.pages_per_head),
            (max(stable_rows, 1), group, max(working, 1)))


@dataclass
class ExactInputs:
    """What the exact rescoring reads: ``query`` ``[B * H, G, D]`` the rows' queries in the keys' own axes,
    ``pool_k`` ``[slots, ps, D]`` the device pool's keys, the attention's softmax ``scale`` and the layer's
    :class:`ExactScratch`."""

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
    rescore_pages(inputs, exact, scores, working_scores)
    list_pages(inputs, scores, working_scores, flat, indptr, table_out, working_scored=True)


def rescore_pages(inputs: TableInputs, exact: ExactInputs, scores: torch.Tensor, working_scores: torch.Tensor
                  ) -> None:
    """Replace the unstable rows' box ``scores [B * hu, >= P]`` by the exact scores of their top ``2K`` (``-inf``
    for the others; rows within the budget are left alone) and fill the stable rows' ``working_scores
    [B * hs, K - 1 + C]`` with their working sets' exact scores (with standby pages)."""
    batch = inputs.num_tokens.shape[0]
    group = exact.query.shape[1]
    num_heads = exact.query.shape[0] // batch
    page_size, k = inputs.page_size, inputs.pages_per_head
    log2_scale = exact.scale * math.log2(math.e)
    block_pages = max(1, MASS_TOKENS // page_size)
    num_unstable = inputs.unstable_heads.numel()
    if num_unstable:
        capacity = inputs.kmin.shape[2]
        block_scores = triton.next_power_of_2(max(capacity, 16))
        _candidates_kernel[(batch * num_unstable,)](
            scores, inputs.table, inputs.num_tokens, exact.scratch.candidates, exact.scratch.candidate_slots, exact.scratch.candidate_lens,
            num_unstable, inputs.table.shape[2], scores.shape[1], K=k, PAGE_SIZE=page_size,
            BLOCK_C=triton.next_power_of_2(2 * k), BLOCK_S=block_scores, num_warps=max(4, min(16, block_scores // 256)),
        )
        _page_mass(inputs, exact, exact.scratch.candidates, exact.scratch.unstable_mass, inputs.unstable_heads, num_heads,
                   log2_scale, block_pages, stable=False)
        _page_shares_kernel[(batch * num_unstable,)](
            exact.scratch.unstable_mass, exact.scratch.candidates, scores, inputs.num_tokens, num_unstable, scores.shape[1],
            COUNT=2 * k, PAGE_SIZE=page_size, GROUP=group, BLOCK=triton.next_power_of_2(2 * k), STABLE=False,
        )
    working = inputs.selected.shape[1] if inputs.stable_heads.numel() else 0
    if working > k - 1:  # standby pages: the working set is ranked at every step
        num_stable = inputs.stable_heads.numel()
        _page_mass(inputs, exact, inputs.selected, exact.scratch.stable_mass, inputs.stable_heads, num_heads, log2_scale,
                   block_pages, stable=True)
        _page_shares_kernel[(batch * num_stable,)](
            exact.scratch.stable_mass, inputs.selected, working_scores, inputs.num_tokens, num_stable, working,
            COUNT=working, PAGE_SIZE=page_size, GROUP=group, BLOCK=triton.next_power_of_2(working), STABLE=True,
        )


def _page_mass(inputs: TableInputs, exact: ExactInputs, pages: torch.Tensor, mass: torch.Tensor,
               heads: torch.Tensor, num_heads: int, log2_scale: float, block_pages: int, stable: bool) -> None:
    """Launch ``_page_mass_kernel`` over the rows of ``heads`` and their listed ``pages [rows, W]``."""
    batch = inputs.num_tokens.shape[0]
    group, head_dim = exact.query.shape[1:]
    count = pages.shape[1]
    _page_mass_kernel[(batch * heads.numel(), triton.cdiv(count, block_pages))](
        exact.query, exact.pool_k, pages, exact.scratch.candidate_slots, exact.scratch.candidate_lens, heads, mass, heads.numel(),
        num_heads, inputs.stable_base, log2_scale, COUNT=count, PAGE_SIZE=inputs.page_size, GROUP=group,
        HEAD_DIM=head_dim, BLOCK_W=block_pages, STABLE=stable,
    )


@triton.jit(do_not_specialize=["num_unstable", "table_capacity", "scores_stride"])
def _candidates_kernel(scores_ptr, table_ptr, num_tokens_ptr, pages_ptr, slots_ptr, lens_ptr, num_unstable,
                       table_capacity, scores_stride, K: tl.constexpr, PAGE_SIZE: tl.constexpr,
                       BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    index = tl.program_id(0)  # unstable row b * hu + i
    n = tl.load(num_tokens_ptr + index // num_unstable).to(tl.int32)
    num_pages = (n + PAGE_SIZE - 1) // PAGE_SIZE
    last_len = n - (num_pages - 1) * PAGE_SIZE
    c = tl.arange(0, BLOCK_C)
    out = index.to(tl.int64) * 2 * K + c
    tl.store(pages_ptr + out, tl.full([BLOCK_C], -1, tl.int64), mask=c < 2 * K)
    tl.store(slots_ptr + out, tl.full([BLOCK_C], -1, tl.int64), mask=c < 2 * K)
    tl.store(lens_ptr + out, tl.zeros([BLOCK_C], tl.int64), mask=c < 2 * K)
    tl.debug_barrier()
    if num_pages > K:  # rows within the budget list every page, unscored
        page = tl.arange(0, BLOCK_S)
        valid = page < num_pages
        row_scores = scores_ptr + index.to(tl.int64) * scores_stride
        chosen = valid
        if num_pages > 2 * K:
            key = _order_key(tl.load(row_scores + page, mask=valid, other=0.0)).to(tl.int64)
            chosen = _top_keys(key, valid, 2 * K)
        tl.store(row_scores + page, tl.full([BLOCK_S], float("-inf"), tl.float32), mask=valid & ~chosen)
        position = index.to(tl.int64) * 2 * K + tl.cumsum(chosen.to(tl.int32), axis=0) - 1
        tl.store(pages_ptr + position, page.to(tl.int64), mask=chosen)
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


@triton.jit(do_not_specialize=["num_listed", "out_stride"])
def _page_shares_kernel(mass_ptr, pages_ptr, out_ptr, num_tokens_ptr, num_listed, out_stride,
                        COUNT: tl.constexpr, PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
                        STABLE: tl.constexpr):
    """Row ``index``: ``log sum_g share_g`` of each listed page from its log2 masses ``[GROUP, COUNT]``; an unstable
    row's into its page-indexed ``out`` row (the sink and the tail keep their ``+inf``), a stable row's at the
    page's working-set slot."""
    index = tl.program_id(0)
    w = tl.arange(0, BLOCK)
    in_list = w < COUNT
    page = tl.load(pages_ptr + index.to(tl.int64) * COUNT + w, mask=in_list, other=-1)
    if tl.max(page, axis=0) >= 0:  # a row within the budget lists no candidates
        mass_row = mass_ptr + index.to(tl.int64) * GROUP * COUNT + w
        # share_g = mass_g - log2 sum_w 2^mass_g, all in log2; then log2 sum_g 2^share_g, both with their maxima out.
        top_share = tl.full([BLOCK], float("-inf"), tl.float32)
        for g in tl.static_range(GROUP):
            mass = tl.load(mass_row + g * COUNT, mask=in_list, other=float("-inf"))
            share = mass - _log2_sum_exp2(mass)
            top_share = tl.maximum(top_share, share)
        safe_top = tl.where(top_share == float("-inf"), 0.0, top_share)
        total = tl.zeros([BLOCK], tl.float32)
        for g in tl.static_range(GROUP):
            mass = tl.load(mass_row + g * COUNT, mask=in_list, other=float("-inf"))
            total += tl.exp2(mass - _log2_sum_exp2(mass) - safe_top)
        score = (safe_top + tl.log2(total)) * 0.6931471805599453  # natural log, as exact_page_scores
        score = tl.where(total > 0, score, float("-inf"))
        out_row = out_ptr + index.to(tl.int64) * out_stride
        if STABLE:
            tl.store(out_row + w, score, mask=in_list)
        else:
            n = tl.load(num_tokens_ptr + index // num_listed).to(tl.int32)
            num_pages = (n + PAGE_SIZE - 1) // PAGE_SIZE
            forced = (page == 0) | (page == num_pages - 1)
            tl.store(out_row + page, score, mask=(page >= 0) & ~forced)


@triton.jit
def _log2_sum_exp2(mass):
    """``log2 sum 2^mass`` over a row (``-inf`` for a row of ``-inf``)."""
    top = tl.max(mass, axis=0)
    safe = tl.where(top == float("-inf"), 0.0, top)
    return safe + tl.log2(tl.sum(tl.exp2(mass - safe), axis=0))
