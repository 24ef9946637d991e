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
def _rerank_kernel(scores_ptr, num_full_ptr, selected_ptr, selected_scores_ptr, new_pages_ptr, copy_src_ptr,
                   copy_dst_ptr, copy_mask_ptr, promoted_ptr, held_ptr, scores_stride, base, host_pages_per_row,
                   max_promotions, SLOTS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
                   LIMITED: tl.constexpr):
    row = tl.program_id(0)
    n = tl.load(num_full_ptr + row).to(tl.int32)  # candidate pages: the row's full pages
    page = tl.arange(0, BLOCK_S)
    columns = tl.arange(0, BLOCK_K)
    valid = page < n
    scores_row = scores_ptr + row.to(tl.int64) * scores_stride
    key = _order_key(tl.where(page == 0, float("inf"), tl.load(scores_row + page, mask=valid, other=0.0)))
    key = key.to(tl.int64)
    if LIMITED:
        valid = _limit_promotions(key, valid, page, columns, selected_ptr + row.to(tl.int64) * SLOTS,
                                  held_ptr + row.to(tl.int64) * BLOCK_S, max_promotions, SLOTS)
    if tl.sum(valid.to(tl.int32), axis=0) > SLOTS:  # ties go to the lower pages
        chosen = _top_keys(key, valid, SLOTS)
    else:
        chosen = valid
    # The new pages in ascending order, -1 padded: through this row's scratch (a register vector cannot be indexed).
    scratch = new_pages_ptr + row.to(tl.int64) * BLOCK_K
    tl.store(scratch + columns, tl.full([BLOCK_K], -1, tl.int64))
    tl.debug_barrier()
    tl.store(scratch + tl.cumsum(chosen.to(tl.int32), axis=0) - 1, page.to(tl.int64), mask=chosen)
    tl.debug_barrier()
    new = tl.load(scratch + columns)
    listed = columns < SLOTS
    old = tl.load(selected_ptr + row.to(tl.int64) * SLOTS + columns, mask=listed, other=-1)
    same = ((old[:, None] == new[None, :]) & (old[:, None] >= 0)).to(tl.int32)  # [old slot j, new entry i]
    keep = tl.max(same, axis=1) > 0
    promoted = (new >= 0) & (tl.max(same, axis=0) == 0)
    # The r-th promoted page (ascending) takes the r-th free slot (by column).
    free = listed & (tl.max(same, axis=1) == 0)
    free_rank = tl.cumsum(free.to(tl.int32), axis=0) - 1
    promoted_rank = tl.cumsum(promoted.to(tl.int32), axis=0) - 1
    pair = free[:, None] & promoted[None, :] & (free_rank[:, None] == promoted_rank[None, :])
    target = tl.sum(tl.where(pair, columns[:, None], 0), axis=0)  # [i] slot of new entry i
    placed = tl.sum(tl.where(pair, new[None, :] + 1, 0), axis=1) - 1  # [j] promoted page put in slot j, or -1
    updated = tl.where(keep, old, placed)
    # Warps hold their own copies of the row: all must have read the old selection before any warp overwrites it.
    tl.debug_barrier()
    tl.store(selected_ptr + row.to(tl.int64) * SLOTS + columns, updated, mask=listed)
    held = tl.load(scores_row + tl.maximum(updated, 0), mask=listed & (updated >= 0), other=0.0)
    held = tl.where(updated == 0, float("inf"), tl.where(updated < 0, float("-inf"), held))
    tl.store(selected_scores_ptr + row.to(tl.int64) * SLOTS + columns, held, mask=listed)
    out = row.to(tl.int64) * BLOCK_K + columns
    tl.store(copy_src_ptr + out, row.to(tl.int64) * host_pages_per_row + tl.maximum(new, 0))
    tl.store(copy_dst_ptr + out, base + row.to(tl.int64) * (SLOTS + 1) + target)
    tl.store(copy_mask_ptr + out, promoted.to(tl.int8))
    tl.atomic_add(promoted_ptr, tl.sum(promoted.to(tl.int64), axis=0))


MAX_RERANK_SLOTS = 128  # selection slots per row: the kernel pairs slots in [slots x slots] tiles


def fits_fused_rerank(scores: torch.Tensor, slots: int) -> bool:
    """Whether :func:`rerank_rows` takes these fp32 ``scores [R, W]`` (rows held in registers) and ``slots`` per row;
    other cases (very long rows, very large budgets) take the torch path."""
    return scores.dtype == torch.float32 and scores.shape[1] <= MAX_SCORED_PAGES and slots <= MAX_RERANK_SLOTS


def rerank_rows(scores: torch.Tensor, num_full_pages: torch.Tensor, selected: torch.Tensor,
                selected_scores: torch.Tensor, host: tuple[torch.Tensor, torch.Tensor],
                pool: tuple[torch.Tensor, torch.Tensor], base: int, host_pages_per_row: int,
                centre: torch.Tensor | None = None, max_promotions: int | None = None) -> torch.Tensor:
    """Rerank every stable row: select the top ``K - 1`` full pages (sink forced), keep the slots of pages still
    selected, give each newly promoted page a free slot and copy it there from the host tier.

    Args:
        scores: ``[R, W]`` fp32 page scores (``W`` >= every row's full pages).
        num_full_pages: ``[R]`` int64 full pages of each row (the candidates; the tail page is not one).
        selected, selected_scores: ``[R, K - 1]`` int64 / fp32 selection state, updated in place.
        host: the host tier ``(k, v)`` as pinned pages ``[R * P, ps, D]``; pool: the device pages ``[S, ps, D]``,
            row ``r``'s slots at ``base + r * K + j``.
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
    indices = torch.empty(3, rows * block_k, dtype=torch.long, device=scores.device)  # new pages, copy src, dst
    copy_mask = torch.empty(rows * block_k, dtype=torch.int8, device=scores.device)
    promoted = torch.zeros(1, dtype=torch.long, device=scores.device)
    limited = max_promotions is not None
    held = torch.empty(rows * block_s if limited else 1, dtype=torch.int8, device=scores.device)  # scratch
    _rerank_kernel[(rows,)](
        scores, num_full_pages, selected, selected_scores, indices[0], indices[1], indices[2], copy_mask, promoted,
        held, scores.stride(0), base, host_pages_per_row, max_promotions or 0, SLOTS=slots, BLOCK_K=block_k,
        BLOCK_S=block_s, LIMITED=limited, num_warps=selection_warps(block_s),
    )
    copy_pages(host, pool, indices[1], indices[2], copy_mask, centre, 1, host_pages_per_row)
    return promoted
