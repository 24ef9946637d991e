"""Fused per-layer decode table (Triton): Quest scoring, top-K, and the page list every row attends to.

One launch per layer and step replaces ~40 small torch ops. Each program handles one row (request, KV head):

- an *unstable* row scores its pages from the key min/max (read once, all ``G`` query heads of the group),
  forces the sink and tail pages, finds the K-th largest score by bisection over order-preserving integer keys
  (ties go to the lower page, like :func:`~flexicache.selection.select_pages`), and lists the chosen pages in
  ascending order (tail last) through the page table;
- a *stable* row lists its selection slots that hold a page, then its tail slot.

Outputs are the padded ``[B * H, K]`` slot/length table of the backend interface and, when given, the compacted
FlashInfer index buffer (``indices[indptr[r] + j]``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _order_key(scores):
    """fp32 -> int32 keys with the same order (negative floats have their magnitude bits flipped)."""
    bits = scores.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _store_row(out_slots_ptr, out_lens_ptr, flat_ptr, indptr_ptr, row, positions, slots, lengths, mask,
               K: tl.constexpr, BLOCK_K: tl.constexpr, WRITE_FLAT: tl.constexpr):
    """Write listed entries (``mask``) of ``row`` at ``positions``; the padded table must be cleared first."""
    out = row.to(tl.int64) * K + positions
    tl.store(out_slots_ptr + out, slots.to(tl.int64), mask=mask)
    tl.store(out_lens_ptr + out, lengths.to(tl.int64), mask=mask)
    if WRITE_FLAT:
        tl.store(flat_ptr + tl.load(indptr_ptr + row) + positions, slots.to(tl.int32), mask=mask)


@triton.jit
def _decode_table_kernel(
    query_ptr, kmin_ptr, kmax_ptr, table_ptr, selected_ptr, num_tokens_ptr, unstable_heads_ptr, stable_heads_ptr,
    scores_ptr, pages_ptr, out_slots_ptr, out_lens_ptr, flat_ptr, indptr_ptr,
    num_unstable_rows, num_unstable, num_stable, num_heads, meta_capacity, table_capacity, stable_base,
    scores_stride, max_pages,
    K: tl.constexpr, PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, REDUCE_SUM: tl.constexpr, WRITE_FLAT: tl.constexpr,
):
    pid = tl.program_id(0)
    k_offsets = tl.arange(0, BLOCK_K)
    in_row = k_offsets < K
    if pid < num_unstable_rows:
        index = pid
        batch = pid // num_unstable
        row = batch * num_heads + tl.load(unstable_heads_ptr + pid % num_unstable)
    else:
        index = pid - num_unstable_rows
        batch = index // num_stable
        row = batch * num_heads + tl.load(stable_heads_ptr + index % num_stable)
    n = tl.load(num_tokens_ptr + batch).to(tl.int32)
    num_pages = (n + PAGE_SIZE - 1) // PAGE_SIZE
    last_len = n - (num_pages - 1) * PAGE_SIZE
    out = row.to(tl.int64) * K + k_offsets
    tl.store(out_slots_ptr + out, tl.full([BLOCK_K], -1, tl.int64), mask=in_row)
    tl.store(out_lens_ptr + out, tl.zeros([BLOCK_K], tl.int64), mask=in_row)
    tl.debug_barrier()
    if pid < num_unstable_rows:
        if num_pages <= K:  # every page fits: list them all
            pages = k_offsets
        else:
            row_scores = scores_ptr + pid.to(tl.int64) * scores_stride
            meta_row = row.to(tl.int64) * meta_capacity * HEAD_DIM
            dims = tl.arange(0, HEAD_DIM)
            for start in range(0, max_pages, BLOCK_P):
                page = start + tl.arange(0, BLOCK_P)
                valid = page < num_pages
                offsets = meta_row + page[:, None].to(tl.int64) * HEAD_DIM + dims[None, :]
                kmin = tl.load(kmin_ptr + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
                kmax = tl.load(kmax_ptr + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
                if REDUCE_SUM:
                    score = tl.zeros([BLOCK_P], dtype=tl.float32)
                else:
                    score = tl.full([BLOCK_P], float("-inf"), dtype=tl.float32)
                for g in tl.static_range(GROUP):
                    q = tl.load(query_ptr + (row.to(tl.int64) * GROUP + g) * HEAD_DIM + dims).to(tl.float32)
                    bound = tl.sum(tl.maximum(q[None, :] * kmax, q[None, :] * kmin), axis=1)
                    if REDUCE_SUM:
                        score += bound
                    else:
                        score = tl.maximum(score, bound)
                score = tl.where((page == 0) | (page == num_pages - 1), float("inf"), score)
                tl.store(row_scores + page, score, mask=valid)
            tl.debug_barrier()
            # The K-th largest key by bisection: the largest t with count(key >= t) >= K.
            low = tl.full([], -2147483648, tl.int64)
            high = tl.full([], 2147483647, tl.int64)
            for _ in range(32):
                middle = (low + high + 1) // 2
                above = tl.zeros([], dtype=tl.int32)
                for start in range(0, max_pages, BLOCK_P):
                    page = start + tl.arange(0, BLOCK_P)
                    valid = page < num_pages
                    key = _order_key(tl.load(row_scores + page, mask=valid, other=0.0)).to(tl.int64)
                    above += tl.sum((valid & (key >= middle)).to(tl.int32))
                if above >= K:
                    low = middle
                else:
                    high = middle - 1
            greater = tl.zeros([], dtype=tl.int32)
            for start in range(0, max_pages, BLOCK_P):
                page = start + tl.arange(0, BLOCK_P)
                valid = page < num_pages
                key = _order_key(tl.load(row_scores + page, mask=valid, other=0.0)).to(tl.int64)
                greater += tl.sum((valid & (key > low)).to(tl.int32))
            ties_wanted = K - greater
            # Chosen pages in ascending order (the tail, the highest page, lands last); ties to lower pages.
            row_pages = pages_ptr + pid.to(tl.int64) * K
            written = tl.zeros([], dtype=tl.int32)
            ties_seen = tl.zeros([], dtype=tl.int32)
            for start in range(0, max_pages, BLOCK_P):
                page = start + tl.arange(0, BLOCK_P)
                valid = page < num_pages
                key = _order_key(tl.load(row_scores + page, mask=valid, other=0.0)).to(tl.int64)
                tie = valid & (key == low)
                tie_rank = ties_seen + tl.cumsum(tie.to(tl.int32), axis=0) - 1
                chosen = valid & ((key > low) | (tie & (tie_rank < ties_wanted)))
                position = written + tl.cumsum(chosen.to(tl.int32), axis=0) - 1
                tl.store(row_pages + position, page, mask=chosen)
                written += tl.sum(chosen.to(tl.int32))
                ties_seen += tl.sum(tie.to(tl.int32))
            tl.debug_barrier()
            pages = tl.load(row_pages + k_offsets, mask=in_row, other=0)
        listed = k_offsets < tl.minimum(num_pages, K)
        slots = tl.load(table_ptr + pid.to(tl.int64) * table_capacity + pages, mask=listed, other=-1)
        lengths = tl.where(pages == num_pages - 1, last_len, PAGE_SIZE)
        _store_row(out_slots_ptr, out_lens_ptr, flat_ptr, indptr_ptr, row, k_offsets, slots, lengths, listed,
                   K, BLOCK_K, WRITE_FLAT)
    else:
        selected = tl.load(selected_ptr + index.to(tl.int64) * (K - 1) + k_offsets, mask=k_offsets < K - 1,
                           other=-1)
        held = selected >= 0
        count = tl.sum(held.to(tl.int32))
        first_slot = stable_base + index.to(tl.int64) * K
        positions = tl.cumsum(held.to(tl.int32), axis=0) - 1
        _store_row(out_slots_ptr, out_lens_ptr, flat_ptr, indptr_ptr, row, positions, first_slot + k_offsets,
                   tl.full([BLOCK_K], PAGE_SIZE, tl.int32), held, K, BLOCK_K, WRITE_FLAT)
        tail = k_offsets == 0
        _store_row(out_slots_ptr, out_lens_ptr, flat_ptr, indptr_ptr, row, count + k_offsets,
                   first_slot + K - 1 + k_offsets, last_len + k_offsets, tail, K, BLOCK_K, WRITE_FLAT)


def decode_table(
    query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, table: torch.Tensor | None,
    selected: torch.Tensor | None,
    num_tokens: torch.Tensor, unstable_heads: torch.Tensor, stable_heads: torch.Tensor, stable_base: int,
    pages_per_head: int, page_size: int, group_reduce: str, max_pages: int, flat: torch.Tensor | None = None,
    indptr: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(slots, page_lens)`` table ``[B * H, K]`` of one layer's decode step.

    Args:
        query: ``[B * H, G, D]`` rows of queries (row ``b * H + h``).
        kmin, kmax: ``[B, H, P, D]`` page min/max of every head.
        table: ``[B, hu, P']`` pool slot of every page of the unstable heads (``None`` if there are none).
        selected: ``[B * hs, K - 1]`` pages held by the stable heads' selection slots (``None`` if none).
        num_tokens: ``[B]`` real tokens per request (after this step's token).
        unstable_heads, stable_heads: int32 head indices of the two classes.
        stable_base: first pool slot of the stable heads' slot range.
        max_pages: pages of the longest request (loop bound).
        flat, indptr: FlashInfer index buffer and ``[B * H + 1]`` row offsets to fill too (optional).
    """
    rows, group, head_dim = query.shape
    batch = num_tokens.shape[0]
    num_unstable, num_stable = unstable_heads.numel(), stable_heads.numel()
    device = query.device
    slots = torch.empty(rows, pages_per_head, dtype=torch.long, device=device)
    lens = torch.empty_like(slots)
    meta_capacity = kmin.shape[2]
    scores_stride = max(meta_capacity, 1)
    scores = torch.empty(max(batch * num_unstable, 1), scores_stride, dtype=torch.float32, device=device)
    pages = torch.empty(max(batch * num_unstable, 1), pages_per_head, dtype=torch.int32, device=device)
    unused = slots  # stands in for absent tensors; never read
    _decode_table_kernel[(batch * (num_unstable + num_stable),)](
        query, kmin, kmax,
        table if num_unstable else unused, selected if num_stable else unused, num_tokens,
        unstable_heads if num_unstable else unused, stable_heads if num_stable else unused, scores, pages, slots,
        lens, flat if flat is not None else unused, indptr if indptr is not None else unused,
        batch * num_unstable, max(num_unstable, 1), max(num_stable, 1), rows // batch, meta_capacity,
        table.shape[2] if num_unstable else 0, stable_base, scores_stride, max_pages,
        K=pages_per_head, PAGE_SIZE=page_size, GROUP=group, HEAD_DIM=head_dim, BLOCK_P=128,
        BLOCK_K=triton.next_power_of_2(pages_per_head), REDUCE_SUM=group_reduce == "sum",
        WRITE_FLAT=flat is not None,
    )
    return slots, lens


@triton.jit
def _append_token_kernel(keys_ptr, values_ptr, pool_k_ptr, pool_v_ptr, kmin_ptr, kmax_ptr, write_slots_ptr,
                         page_ptr, offset_ptr, num_heads, meta_capacity,
                         PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    row = tl.program_id(0)  # b * H + h
    batch = row // num_heads
    dims = tl.arange(0, HEAD_DIM)
    key = tl.load(keys_ptr + row.to(tl.int64) * HEAD_DIM + dims)
    value = tl.load(values_ptr + row.to(tl.int64) * HEAD_DIM + dims)
    offset = tl.load(offset_ptr + batch)
    token = (tl.load(write_slots_ptr + row) * PAGE_SIZE + offset) * HEAD_DIM
    tl.store(pool_k_ptr + token + dims, key)
    tl.store(pool_v_ptr + token + dims, value)
    meta = (row.to(tl.int64) * meta_capacity + tl.load(page_ptr + batch)) * HEAD_DIM + dims
    opens = offset == 0
    tl.store(kmin_ptr + meta, tl.where(opens, key, tl.minimum(tl.load(kmin_ptr + meta), key)))
    tl.store(kmax_ptr + meta, tl.where(opens, key, tl.maximum(tl.load(kmax_ptr + meta), key)))


def append_token(keys: torch.Tensor, values: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
                 kmin: torch.Tensor, kmax: torch.Tensor, write_slots: torch.Tensor, page: torch.Tensor,
                 offset: torch.Tensor) -> None:
    """Decode step of one layer in one launch: write each row's token (``keys``/``values`` ``[B, H, D]``) at
    ``offset [B]`` of pool slot ``write_slots [B, H]`` and fold its key into the min/max of page ``page [B]``
    (``kmin``/``kmax`` ``[B, H, P, D]``; a page opening at offset 0 starts from the key)."""
    batch, num_heads, head_dim = keys.shape
    _append_token_kernel[(batch * num_heads,)](
        keys.contiguous(), values.contiguous(), pool_k, pool_v, kmin, kmax, write_slots, page, offset, num_heads,
        kmin.shape[2], PAGE_SIZE=pool_k.shape[1], HEAD_DIM=head_dim,
    )
