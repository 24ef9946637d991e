"""A stable-head rerank in two launches (Triton): selection, bookkeeping and the promotion copy.

Without it, a rerank of one layer's stable rows is ~100 small torch operations (selection by sort, membership of
old and new pages, pairing promoted pages with free slots, index arithmetic for the copy): milliseconds of host
time on the GPU path. :func:`rerank_rows` does the same in one program per row plus the zero-copy page copy of
:mod:`flexicache.backends.triton_transfer`, with results identical to
:meth:`flexicache.offload.OffloadedPages.rerank`'s torch path: same page choice (sink forced, ties to the lower
page, as :func:`~flexicache.selection.select_pages`), same slots for kept and promoted pages, same scores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flexicache.backends.triton_select import MAX_SCORED_PAGES, _order_key, _top_keys, selection_warps
from flexicache.backends.triton_transfer import copy_pages
from flexicache.config import MAX_WORKING_SET_SLOTS


@triton.jit
def _limit_promotions(key, valid, page, columns, selected_row, held_row, max_promotions, SLOTS: tl.constexpr):
    """Mask of the pages a limited rerank may choose from: the row's held pages and its best ``max_promotions`` +
    (empty slots) others (:func:`flexicache.selection.limit_promotions`). ``held_row``: the row's ``[BLOCK_S]``
    int8 scratch."""
    old = tl.load(selected_row + columns, mask=columns < SLOTS, other=-1)
    tl.store(held_row + page, tl.zeros_like(page).to(tl.int8))
    tl.debug_barrier()
    tl.store(held_row + tl.maximum(old, 0), tl.full(old.shape, 1, tl.int8), mask=old >= 0)
    tl.debug_barrier()
    held = valid & (tl.load(held_row + page) > 0)
    newcomers = valid & ~held
    room = max_promotions + tl.sum(((columns < SLOTS) & (old < 0)).to(tl.int32), axis=0)
    count = tl.sum(newcomers.to(tl.int32), axis=0)
    if room < count:
        admitted = _top_keys(key, newcomers, room)
    else:
        admitted = newcomers
    return held | admitted


@triton.jit(do_not_specialize=["scores_stride", "base", "host_pages_per_row", "max_promotions"])
def _rerank_kernel(scores_ptr, num_full_ptr, selected_ptr, selected_scores_ptr, page_scratch_ptr, free_scratch_ptr,
                   copy_src_ptr, copy_dst_ptr, copy_mask_ptr, promoted_ptr, held_ptr, scores_stride, base,
                   host_pages_per_row, max_promotions, SLOTS: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_S: tl.constexpr, LIMITED: tl.constexpr):
    row = tl.program_id(0)
    n = tl.load(num_full_ptr + row).to(tl.int32)  # candidate pages: the row's full pages
    page = tl.arange(0, BLOCK_S)
    columns = tl.arange(0, BLOCK_K)
    listed = columns < SLOTS
    scores_row = scores_ptr + row.to(tl.int64) * scores_stride
    selected_row = selected_ptr + row.to(tl.int64) * SLOTS
    score = tl.load(scores_row + page, mask=page < n, other=float("-inf"))
    # A -inf score is no candidate (select_pages' padding), but the sink of a row with full pages is forced.
    valid = (page < n) & ((score != float("-inf")) | (page == 0))
    key = _order_key(tl.where(page == 0, float("inf"), score)).to(tl.int64)
    if LIMITED:
        valid = _limit_promotions(key, valid, page, columns, selected_row, held_ptr + row.to(tl.int64) * BLOCK_S,
                                  max_promotions, SLOTS)
    if tl.sum(valid.to(tl.int32), axis=0) > SLOTS:  # ties go to the lower pages
        chosen = _top_keys(key, valid, SLOTS)
    else:
        chosen = valid
    # Which pages were held and which held pages stay, through a per-page scratch (a register vector cannot be
    # indexed by another): first the old selection's pages, then the chosen ones.
    old = tl.load(selected_row + columns, mask=listed, other=-1)
    marks = page_scratch_ptr + row.to(tl.int64) * BLOCK_S
    tl.store(marks + page, tl.zeros([BLOCK_S], tl.int32))
    tl.debug_barrier()
    tl.store(marks + tl.maximum(old, 0), tl.full([BLOCK_K], 1, tl.int32), mask=old >= 0)
    tl.debug_barrier()
    promoted = chosen & (tl.load(marks + page) == 0)
    tl.debug_barrier()
    tl.store(marks + page, chosen.to(tl.int32))
    tl.debug_barrier()
    keep = (old >= 0) & (tl.load(marks + tl.maximum(old, 0), mask=old >= 0, other=0) > 0)
    # The r-th promoted page (ascending) takes the r-th free slot (by column): the free columns listed in order.
    free = listed & ~keep
    free_slots = free_scratch_ptr + row.to(tl.int64) * BLOCK_K
    tl.store(free_slots + tl.cumsum(free.to(tl.int32), axis=0) - 1, columns.to(tl.int64), mask=free)
    tl.store(selected_row + columns, tl.where(keep, old, -1), mask=listed)  # every warp has read the old selection
    tl.debug_barrier()
    rank = tl.cumsum(promoted.to(tl.int32), axis=0) - 1
    # A consistent selection has a free slot for every promoted page; one holding a page twice would not: its extra
    # promotions are dropped rather than written through an unset free-slot entry.
    promoted = promoted & (rank < tl.sum(free.to(tl.int32), axis=0))
    target = tl.load(free_slots + rank, mask=promoted, other=0)
    tl.store(selected_row + target, page.to(tl.int64), mask=promoted)
    tl.debug_barrier()
    updated = tl.load(selected_row + columns, mask=listed, other=-1)
    held = tl.load(scores_row + tl.maximum(updated, 0), mask=listed & (updated >= 0), other=0.0)
    held = tl.where(updated == 0, float("inf"), tl.where(updated < 0, float("-inf"), held))
    tl.store(selected_scores_ptr + row.to(tl.int64) * SLOTS + columns, held, mask=listed)
    out = row.to(tl.int64) * BLOCK_K
    tl.store(copy_mask_ptr + out + columns, tl.zeros([BLOCK_K], tl.int8))
    tl.debug_barrier()
    tl.store(copy_src_ptr + out + rank, row.to(tl.int64) * host_pages_per_row + page, mask=promoted)
    tl.store(copy_dst_ptr + out + rank, base + row.to(tl.int64) * (SLOTS + 1) + target, mask=promoted)
    tl.store(copy_mask_ptr + out + rank, tl.full([BLOCK_S], 1, tl.int8), mask=promoted)
    tl.atomic_add(promoted_ptr, tl.sum(promoted.to(tl.int64), axis=0))


MAX_RERANK_SLOTS = MAX_WORKING_SET_SLOTS  # working-set slots per row the fused rerank holds as register vectors


def fits_fused_rerank(scores: torch.Tensor, slots: int) -> bool:
    """Whether :func:`rerank_rows` takes these fp32 ``scores [R, W]`` (rows held in registers) and ``slots`` per row;
    other cases (very long rows, very large budgets) take the torch path."""
    return scores.dtype == torch.float32 and scores.shape[1] <= MAX_SCORED_PAGES and slots <= MAX_RERANK_SLOTS


def rerank_rows(scores: torch.Tensor, num_full_pages: torch.Tensor, selected: torch.Tensor,
                selected_scores: torch.Tensor, host: tuple[torch.Tensor, torch.Tensor],
                pool: tuple[torch.Tensor, torch.Tensor], base: int, host_pages_per_row: int,
                centre: torch.Tensor | None = None, max_promotions: int | None = None) -> torch.Tensor:
    """Rerank every stable row: select the top ``W`` full pages (sink forced) for its ``W`` working-set slots, keep
    the slots of pages still selected, give each newly promoted page a free slot and copy it there from the host
    tier.

    Args:
        scores: ``[R, P]`` fp32 page scores (``P`` >= every row's full pages).
        num_full_pages: ``[R]`` int64 full pages of each row (the candidates; the tail page is not one).
        selected, selected_scores: ``[R, W]`` int64 / fp32 selection state, updated in place.
        host: the host tier ``(k, v)`` as pinned pages ``[R * P', ps, D]``; pool: the device pages ``[S, ps, D]``,
            row ``r``'s slots at ``base + r * (W + 1) + j``.
        centre: ``[R, D]`` key centre of each row, added back to the promoted keys (a centred host tier).
        max_promotions: promote at most this many pages per row beyond its empty slots (``None``: no limit).

    Returns:
        ``[1]`` int64 device tensor: pages promoted (copied host to device) by this rerank.
    """
    rows, slots = selected.shape
    if not fits_fused_rerank(scores, slots):
        raise ValueError(f"fused rerank takes fp32 scores of at most {MAX_SCORED_PAGES} pages per row and at most "
                         f"{MAX_RERANK_SLOTS} slots, got {scores.dtype} [{scores.shape[1]} pages], {slots} slots")
    block_k = triton.next_power_of_2(max(slots, 1))
    block_s = triton.next_power_of_2(max(scores.shape[1], 16))
    indices = torch.empty(3, rows * block_k, dtype=torch.long, device=scores.device)  # free slots, copy src, dst
    page_marks = torch.empty(rows * block_s, dtype=torch.int32, device=scores.device)  # scratch
    copy_mask = torch.empty(rows * block_k, dtype=torch.int8, device=scores.device)
    promoted = torch.zeros(1, dtype=torch.long, device=scores.device)
    limited = max_promotions is not None
    held = torch.empty(rows * block_s if limited else 1, dtype=torch.int8, device=scores.device)  # scratch
    _rerank_kernel[(rows,)](
        scores, num_full_pages, selected, selected_scores, page_marks, indices[0], indices[1], indices[2], copy_mask,
        promoted, held, scores.stride(0), base, host_pages_per_row, max_promotions or 0, SLOTS=slots, BLOCK_K=block_k,
        BLOCK_S=block_s, LIMITED=limited, num_warps=selection_warps(block_s),
    )
    copy_pages(host, pool, indices[1], indices[2], copy_mask, centre, 1, host_pages_per_row)
    return promoted
