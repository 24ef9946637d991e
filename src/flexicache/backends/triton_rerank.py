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

from flexicache.backends.triton_select import MAX_SCORED_PAGES, _box_scores, _order_key, _top_keys, selection_warps
from flexicache.backends.triton_transfer import copy_pages
from flexicache.selection import spread_weights


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
def _rerank_kernel(scores_ptr, num_full_ptr, selected_ptr, selected_scores_ptr, standby_ptr, new_pages_ptr,
                   copy_src_ptr, copy_dst_ptr, copy_mask_ptr, promoted_ptr, held_ptr, scores_stride, base,
                   host_pages_per_row, max_promotions, SLOTS: tl.constexpr, STANDBY: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, LIMITED: tl.constexpr):
    row = tl.program_id(0)
    n = tl.load(num_full_ptr + row).to(tl.int32)  # candidate pages: the row's full pages
    page = tl.arange(0, BLOCK_S)
    columns = tl.arange(0, BLOCK_K)
    scores_row = scores_ptr + row.to(tl.int64) * scores_stride
    score = tl.load(scores_row + page, mask=page < n, other=float("-inf"))
    # A -inf score is no candidate (select_pages' padding), but the sink of a row with full pages is forced.
    full = (page < n) & ((score != float("-inf")) | (page == 0))
    valid = full
    key = _order_key(tl.where(page == 0, float("inf"), score)).to(tl.int64)
    if LIMITED:
        valid = _limit_promotions(key, valid, page, columns, selected_ptr + row.to(tl.int64) * SLOTS,
                                  held_ptr + row.to(tl.int64) * BLOCK_S, max_promotions, SLOTS)
    if tl.sum(valid.to(tl.int32), axis=0) > SLOTS:  # ties go to the lower pages
        chosen = _top_keys(key, valid, SLOTS)
    else:
        chosen = valid
    if STANDBY > 0:  # the best full pages outside the new selection, ascending (selection.standby_after)
        outside = full & ~chosen
        if tl.sum(outside.to(tl.int32), axis=0) > STANDBY:
            outside = _top_keys(key, outside, STANDBY)
        standby_row = standby_ptr + row.to(tl.int64) * STANDBY
        spots = tl.arange(0, BLOCK_C)
        tl.store(standby_row + spots, tl.full([BLOCK_C], -1, tl.int64), mask=spots < STANDBY)
        tl.debug_barrier()
        tl.store(standby_row + tl.cumsum(outside.to(tl.int32), axis=0) - 1, page.to(tl.int64), mask=outside)
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


@triton.jit
def _better(key_a, page_a, key_b, page_b):
    """``[A, B]``: whether entry ``a`` ranks above entry ``b`` (higher key, ties to the lower page)."""
    return (key_a[:, None] > key_b[None, :]) | ((key_a[:, None] == key_b[None, :]) & (page_a[:, None] < page_b[None, :]))


@triton.jit
def _rank_in(key, page, key_held, page_held, among_held, key_standby, page_standby, among_standby):
    """Rank of every entry ``(key, page)`` among the held entries ``among_held`` and the standby entries
    ``among_standby`` (how many of them rank above it)."""
    above_held = tl.sum((_better(key_held, page_held, key, page) & among_held[:, None]).to(tl.int32), axis=0)
    above_standby = tl.sum((_better(key_standby, page_standby, key, page) & among_standby[:, None]).to(tl.int32),
                           axis=0)
    return above_held + above_standby


@triton.jit
def _listed_scores(query_ptr, kmin_ptr, kmax_ptr, pages_ptr, out_ptr, query_row, meta_row, count, weight_high,
                   weight_low, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                   REDUCE_SUM: tl.constexpr, SPREAD_WEIGHTED: tl.constexpr):
    """Store the box scores of the ``count`` pages listed at ``pages_ptr`` (``-1``: none) of the metadata row
    starting at page ``meta_row`` at ``out_ptr``, ``CHUNK`` pages at a time."""
    dims = tl.arange(0, HEAD_DIM)
    for start in tl.static_range(0, BLOCK, CHUNK):
        entry = start + tl.arange(0, CHUNK)
        page = tl.load(pages_ptr + entry, mask=entry < count, other=-1)
        offsets = (meta_row + tl.maximum(page, 0)[:, None].to(tl.int64)) * HEAD_DIM + dims[None, :]
        score = _box_scores(query_ptr, query_row, kmin_ptr, kmax_ptr, offsets, page >= 0, weight_high, weight_low,
                            GROUP, HEAD_DIM, CHUNK, REDUCE_SUM, SPREAD_WEIGHTED)
        tl.store(out_ptr + entry, score, mask=entry < count)


@triton.jit(do_not_specialize=["num_stable", "num_heads", "meta_capacity", "base", "host_pages_per_row",
                               "max_promotions", "weight_high", "weight_low"])
def _refresh_kernel(query_ptr, kmin_ptr, kmax_ptr, stable_heads_ptr, selected_ptr, selected_scores_ptr, standby_ptr,
                    entry_scores_ptr, copy_src_ptr, copy_dst_ptr, copy_mask_ptr, promoted_ptr, num_stable, num_heads,
                    meta_capacity, base, host_pages_per_row, max_promotions, weight_high, weight_low,
                    SLOTS: tl.constexpr, STANDBY: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, CHUNK_K: tl.constexpr, CHUNK_C: tl.constexpr,
                    REDUCE_SUM: tl.constexpr, SPREAD_WEIGHTED: tl.constexpr, LIMITED: tl.constexpr):
    row = tl.program_id(0)  # b * hs + i
    batch = row // num_stable
    head_row = (batch * num_heads + tl.load(stable_heads_ptr + row % num_stable)).to(tl.int64)  # b * H + head
    selected_row = selected_ptr + row.to(tl.int64) * SLOTS
    standby_row = standby_ptr + row.to(tl.int64) * STANDBY
    held_scores = entry_scores_ptr + row.to(tl.int64) * (SLOTS + STANDBY)
    standby_scores = held_scores + SLOTS
    # 1. Score the listed pages: the selection's, then the standby ones.
    meta_row = head_row * meta_capacity
    _listed_scores(query_ptr, kmin_ptr, kmax_ptr, selected_row, held_scores, head_row, meta_row, SLOTS, weight_high,
                   weight_low, GROUP, HEAD_DIM, BLOCK_K, CHUNK_K, REDUCE_SUM, SPREAD_WEIGHTED)
    _listed_scores(query_ptr, kmin_ptr, kmax_ptr, standby_row, standby_scores, head_row, meta_row, STANDBY,
                   weight_high, weight_low, GROUP, HEAD_DIM, BLOCK_C, CHUNK_C, REDUCE_SUM, SPREAD_WEIGHTED)
    tl.debug_barrier()
    slot = tl.arange(0, BLOCK_K)
    spot = tl.arange(0, BLOCK_C)
    held_page = tl.load(selected_row + slot, mask=slot < SLOTS, other=-1).to(tl.int32)
    standby_page = tl.load(standby_row + spot, mask=spot < STANDBY, other=-1).to(tl.int32)
    held = held_page >= 0
    waiting = standby_page >= 0
    held_score = tl.load(held_scores + slot, mask=held, other=0.0)
    standby_score = tl.load(standby_scores + spot, mask=waiting, other=0.0)
    held_key = _order_key(tl.where(held_page == 0, float("inf"), held_score))  # the sink stays
    standby_key = _order_key(tl.where(standby_page == 0, float("inf"), standby_score))
    # 2. Which standby pages may come in (selection.limit_promotions), then the top SLOTS of held and admitted.
    admitted = waiting
    if LIMITED:
        room = max_promotions + tl.sum(((slot < SLOTS) & ~held).to(tl.int32), axis=0)
        admitted = waiting & (_rank_in(standby_key, standby_page, held_key, held_page, slot < 0, standby_key,
                                       standby_page, waiting) < room)
    keep = held & (_rank_in(held_key, held_page, held_key, held_page, held, standby_key, standby_page, admitted)
                   < SLOTS)
    promoted = admitted & (_rank_in(standby_key, standby_page, held_key, held_page, held, standby_key, standby_page,
                                    admitted) < SLOTS)
    # 3. The r-th promoted page (ascending: standby pages are kept in order) takes the r-th free slot.
    free = (slot < SLOTS) & ~keep
    pair = (free[:, None] & promoted[None, :]
            & ((tl.cumsum(free.to(tl.int32), axis=0) - 1)[:, None]
               == (tl.cumsum(promoted.to(tl.int32), axis=0) - 1)[None, :]))  # [slot, standby entry]
    target = tl.sum(tl.where(pair, slot[:, None], 0), axis=0)
    placed = tl.sum(tl.where(pair, standby_page[None, :] + 1, 0), axis=1) - 1
    placed_score = tl.sum(tl.where(pair, standby_score[None, :], 0.0), axis=1)
    updated = tl.where(keep, held_page, placed).to(tl.int64)
    updated_score = tl.where(keep, held_score, placed_score)
    updated_score = tl.where(updated == 0, float("inf"), tl.where(updated < 0, float("-inf"), updated_score))
    # 4. The pages that leave (the selection's and the standby's) are the new standby pages, ascending.
    left_held = held & ~keep
    left_standby = waiting & ~promoted
    zero_held = held_page * 0
    zero_standby = standby_page * 0
    position_held = _rank_in(zero_held, held_page, zero_held, held_page, left_held, zero_standby, standby_page,
                             left_standby)
    position_standby = _rank_in(zero_standby, standby_page, zero_held, held_page, left_held, zero_standby,
                                standby_page, left_standby)
    tl.debug_barrier()  # every warp has read the old state
    tl.store(selected_row + slot, updated, mask=slot < SLOTS)
    tl.store(selected_scores_ptr + row.to(tl.int64) * SLOTS + slot, updated_score, mask=slot < SLOTS)
    tl.store(standby_row + spot, tl.full([BLOCK_C], -1, tl.int64), mask=spot < STANDBY)
    tl.debug_barrier()
    tl.store(standby_row + position_held, held_page.to(tl.int64), mask=left_held)
    tl.store(standby_row + position_standby, standby_page.to(tl.int64), mask=left_standby)
    out = row.to(tl.int64) * BLOCK_C + spot
    tl.store(copy_src_ptr + out, row.to(tl.int64) * host_pages_per_row + tl.maximum(standby_page, 0).to(tl.int64))
    tl.store(copy_dst_ptr + out, base + row.to(tl.int64) * (SLOTS + 1) + target)
    tl.store(copy_mask_ptr + out, promoted.to(tl.int8))
    tl.atomic_add(promoted_ptr, tl.sum(promoted.to(tl.int64), axis=0))


MAX_RERANK_SLOTS = 128  # selection slots per row: the kernel pairs slots in [slots x slots] tiles


MAX_REFRESH_STANDBY = 64  # standby pages per row the fused refresh ranks in registers ([slots x standby] tiles)


def fits_fused_refresh(slots: int, standby: int) -> bool:
    """Whether :func:`refresh_rows` takes rows of ``slots`` selection slots and ``standby`` standby pages; larger
    ones take the torch path."""
    return slots <= MAX_RERANK_SLOTS and standby <= MAX_REFRESH_STANDBY


def fits_fused_rerank(scores: torch.Tensor, slots: int) -> bool:
    """Whether :func:`rerank_rows` takes these fp32 ``scores [R, W]`` (rows held in registers) and ``slots`` per row;
    other cases (very long rows, very large budgets) take the torch path."""
    return scores.dtype == torch.float32 and scores.shape[1] <= MAX_SCORED_PAGES and slots <= MAX_RERANK_SLOTS


def rerank_rows(scores: torch.Tensor, num_full_pages: torch.Tensor, selected: torch.Tensor,
                selected_scores: torch.Tensor, host: tuple[torch.Tensor, torch.Tensor],
                pool: tuple[torch.Tensor, torch.Tensor], base: int, host_pages_per_row: int,
                centre: torch.Tensor | None = None, max_promotions: int | None = None,
                standby: torch.Tensor | None = None) -> torch.Tensor:
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
        standby: ``[R, C]`` int64, set in place to each row's best ``C`` full pages outside its new selection,
            ascending, ``-1`` padded (:func:`~flexicache.selection.standby_after`); ``None``: no standby pages.

    Returns:
        ``[1]`` int64 device tensor: pages promoted (copied host to device) by this rerank.
    """
    rows, slots = selected.shape
    if not fits_fused_rerank(scores, slots):
        raise ValueError(f"fused rerank takes fp32 scores of at most {MAX_SCORED_PAGES} pages per row and at most "
                         f"{MAX_RERANK_SLOTS} slots, got {scores.dtype} [{scores.shape[1]} pages], {slots} slots")
    block_k = triton.next_power_of_2(max(slots, 1))
    block_s = triton.next_power_of_2(max(scores.shape[1], 16))
    num_standby = 0 if standby is None else standby.shape[1]
    indices = torch.empty(3, rows * block_k, dtype=torch.long, device=scores.device)  # new pages, copy src, dst
    copy_mask = torch.empty(rows * block_k, dtype=torch.int8, device=scores.device)
    promoted = torch.zeros(1, dtype=torch.long, device=scores.device)
    limited = max_promotions is not None
    held = torch.empty(rows * block_s if limited else 1, dtype=torch.int8, device=scores.device)  # scratch
    _rerank_kernel[(rows,)](
        scores, num_full_pages, selected, selected_scores, selected if standby is None else standby, indices[0],
        indices[1], indices[2], copy_mask, promoted, held, scores.stride(0), base, host_pages_per_row,
        max_promotions or 0, SLOTS=slots, STANDBY=num_standby, BLOCK_K=block_k,
        BLOCK_C=triton.next_power_of_2(max(num_standby, 1)), BLOCK_S=block_s, LIMITED=limited,
        num_warps=selection_warps(block_s),
    )
    copy_pages(host, pool, indices[1], indices[2], copy_mask, centre, 1, host_pages_per_row)
    return promoted


def refresh_rows(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, stable_heads: torch.Tensor,
                 selected: torch.Tensor, selected_scores: torch.Tensor, standby: torch.Tensor,
                 host: tuple[torch.Tensor, torch.Tensor], pool: tuple[torch.Tensor, torch.Tensor], base: int,
                 host_pages_per_row: int, group_reduce: str, spread_weight: float, centre: torch.Tensor | None = None,
                 max_promotions: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Refresh every stable row (:meth:`~flexicache.offload.OffloadedPages.refresh`) in one program per row: score its
    selected and standby pages, keep the best ``K - 1`` (sink forced, ties to the lower page, at most
    ``max_promotions`` standby pages in beyond its empty slots), the others on standby (ascending); then copy the
    promoted pages from the host tier.

    Args:
        query: ``[B * H, G, D]`` every row's queries in the axes of the page boxes (row ``b * H + h``).
        kmin, kmax: ``[B, H, P, D]`` page min/max; stable_heads: ``[hs]`` the stable rows' heads (row ``b * hs + i``
            is head ``stable_heads[i]`` of request ``b``).
        selected, selected_scores: ``[B * hs, K - 1]`` int64 / fp32, standby: ``[B * hs, C]`` int64 (ascending,
            ``-1`` padded): the selection state, updated in place.
        host, pool, base, host_pages_per_row, centre: as for :func:`rerank_rows`.

    Returns:
        ``([1] int64 pages promoted, [B * hs, K - 1 + C] fp32 the listed pages' scores, selected then standby)``.
    """
    rows, slots = selected.shape
    count = standby.shape[1]
    if not fits_fused_refresh(slots, count):
        raise ValueError(f"fused refresh takes at most {MAX_RERANK_SLOTS} slots and {MAX_REFRESH_STANDBY} standby "
                         f"pages per row, got {slots} and {count}")
    group, head_dim = query.shape[1], query.shape[2]
    block_k, block_c = triton.next_power_of_2(max(slots, 1)), triton.next_power_of_2(max(count, 1))
    entry_scores = torch.empty(rows, slots + count, dtype=torch.float32, device=query.device)
    copy_index = torch.empty(2, rows * block_c, dtype=torch.long, device=query.device)  # source, target
    copy_mask = torch.empty(rows * block_c, dtype=torch.int8, device=query.device)
    promoted = torch.zeros(1, dtype=torch.long, device=query.device)
    if rows:
        _refresh_kernel[(rows,)](
            query, kmin, kmax, stable_heads, selected, selected_scores, standby, entry_scores, copy_index[0],
            copy_index[1], copy_mask, promoted, stable_heads.numel(), kmin.shape[1], kmin.shape[2], base,
            host_pages_per_row, max_promotions or 0, *spread_weights(spread_weight), SLOTS=slots, STANDBY=count,
            GROUP=group, HEAD_DIM=head_dim, BLOCK_K=block_k, BLOCK_C=block_c, CHUNK_K=min(32, block_k),
            CHUNK_C=min(32, block_c), REDUCE_SUM=group_reduce == "sum", SPREAD_WEIGHTED=spread_weight != 1.0,
            LIMITED=max_promotions is not None, num_warps=8 if block_k >= 64 else 4,
        )
    copy_pages(host, pool, copy_index[0], copy_index[1], copy_mask, centre, 1, host_pages_per_row)
    return promoted, entry_scores
