"""Page copies between the pinned host tier and device pools without a host synchronisation (Triton).

Pinned host memory is mapped into the device's address space (unified addressing), so one kernel can read host
pages into device slots (promotion) or write device pages into host pages (tail retirement) straight from index
tensors that live on the device: the host never needs to know which pages move. Copies run on the current stream,
ordered with the decode kernels around them. :func:`retire_tails` also does the bookkeeping of a tail retirement
(which selection slot the retired page takes over), so a page boundary costs one launch per layer.

A host tier narrower than the KV (``host_dtype``) gets its keys centred: every host-side key is stored as the key
minus its row's centre ``[R, D]`` (fp32; fp64 for fp64 KV), computed in the centre's dtype and rounded by the store,
and gets the centre back, in that dtype, on its way to the device; values are only cast. Without a centre the
kernels copy and cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["pages_per_row"])
def _copy_pages_kernel(src_k_ptr, src_v_ptr, dst_k_ptr, dst_v_ptr, src_index_ptr, dst_index_ptr, mask_ptr,
                       centre_ptr, pages_per_row, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                       CENTRE_SIGN: tl.constexpr):
    item = tl.program_id(0)
    if tl.load(mask_ptr + item) != 0:
        offsets = tl.arange(0, BLOCK)
        inside = offsets < PAGE
        source_page = tl.load(src_index_ptr + item)
        target_page = tl.load(dst_index_ptr + item)
        keys = tl.load(src_k_ptr + source_page * PAGE + offsets, mask=inside)
        if CENTRE_SIGN == 0:
            tl.store(dst_k_ptr + target_page * PAGE + offsets, keys, mask=inside)
        else:  # +1: host to device (add the centre back), -1: device to host (take it off)
            if CENTRE_SIGN > 0:
                row = source_page // pages_per_row
            else:
                row = target_page // pages_per_row
            centre = tl.load(centre_ptr + row * HEAD_DIM + offsets % HEAD_DIM, mask=inside)
            tl.store(dst_k_ptr + target_page * PAGE + offsets, keys.to(centre.dtype) + CENTRE_SIGN * centre,
                     mask=inside)
        values = tl.load(src_v_ptr + source_page * PAGE + offsets, mask=inside)
        tl.store(dst_v_ptr + target_page * PAGE + offsets, values, mask=inside)


def copy_pages(source: tuple[torch.Tensor, torch.Tensor], target: tuple[torch.Tensor, torch.Tensor],
               source_index: torch.Tensor, target_index: torch.Tensor, mask: torch.Tensor,
               centre: torch.Tensor | None = None, centre_sign: int = 0, pages_per_row: int = 1) -> None:
    """``target[j][target_index[i]] = source[j][source_index[i]]`` for keys and values (``j``) where ``mask[i]``, cast
    to the target's dtype; with ``centre``, keys gain (``centre_sign=1``: from the host tier) or lose (``-1``: to it)
    the centre of the host page's row.

    Args:
        source, target: ``(k, v)`` page arrays ``[N, ps, D]`` (device memory or pinned host memory).
        source_index, target_index: ``[n]`` int64 page indices, on the device.
        mask: ``[n]`` bool or int8 (nonzero: copy), on the device.
        centre: ``[R, D]`` key centre of each host row (fp32, or fp64); host page ``i`` is row ``i // pages_per_row``'s.
    """
    if mask.numel() == 0:
        return
    page, head_dim = source[0].shape[1] * source[0].shape[2], source[0].shape[2]
    _copy_pages_kernel[(mask.numel(),)](
        source[0], source[1], target[0], target[1], source_index, target_index, mask,
        mask if centre is None else centre, pages_per_row, PAGE=page, HEAD_DIM=head_dim,
        BLOCK=triton.next_power_of_2(page), CENTRE_SIGN=0 if centre is None else centre_sign,
    )


@triton.jit(do_not_specialize=["base", "num_heads", "host_pages_per_row"])
def _retire_tails_kernel(pool_k_ptr, pool_v_ptr, host_k_ptr, host_v_ptr, selected_ptr, scores_ptr, batch_ptr,
                         before_ptr, centre_ptr, base, num_heads, host_pages_per_row,
                         K: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, FULL_ONLY: tl.constexpr, CENTRED: tl.constexpr):
    item = tl.program_id(0)
    request = tl.load(batch_ptr + item // num_heads)
    row = request * num_heads + item % num_heads
    before = tl.load(before_ptr + request)
    if FULL_ONLY:  # every request was launched: only those whose tail page is full retire it
        if (before == 0) | (before % PAGE_SIZE != 0):
            return
    page = (before - 1) // PAGE_SIZE  # the full tail page
    offsets = tl.arange(0, BLOCK)
    inside = offsets < PAGE
    tail = (base + row * K + K - 1) * PAGE
    keys = tl.load(pool_k_ptr + tail + offsets, mask=inside)
    values = tl.load(pool_v_ptr + tail + offsets, mask=inside)
    host = (row * host_pages_per_row + page) * PAGE
    if CENTRED:
        centre = tl.load(centre_ptr + row * HEAD_DIM + offsets % HEAD_DIM, mask=inside)
        tl.store(host_k_ptr + host + offsets, keys.to(centre.dtype) - centre, mask=inside)
    else:
        tl.store(host_k_ptr + host + offsets, keys, mask=inside)
    tl.store(host_v_ptr + host + offsets, values, mask=inside)
    # Victim slot: an empty one (-inf) first, else the lowest-scored page, never the sink (page 0); first on ties.
    columns = tl.arange(0, BLOCK_K)
    listed = columns < K - 1
    held = tl.load(selected_ptr + row * (K - 1) + columns, mask=listed, other=-1)
    keep = tl.minimum(tl.load(scores_ptr + row * (K - 1) + columns, mask=listed, other=0.0), 3.4028234663852886e38)
    keep = tl.where(held == 0, float("inf"), keep)
    keep = tl.where(held < 0, float("-inf"), keep)
    keep = tl.where(listed, keep, float("inf"))
    has_victim = tl.min(keep, axis=0) < float("inf")
    victim = tl.argmin(keep, axis=0, tie_break_left=True)
    # Each warp reads the row's scores and picks the victim itself: all must have read them before any warp marks
    # the victim's score +inf below, or a late warp picks another slot and writes its part of the page there.
    tl.debug_barrier()
    if has_victim:
        target = (base + row * K + victim) * PAGE
        tl.store(pool_k_ptr + target + offsets, keys, mask=inside)
        tl.store(pool_v_ptr + target + offsets, values, mask=inside)
        tl.store(selected_ptr + row * (K - 1) + victim, page)
        tl.store(scores_ptr + row * (K - 1) + victim, float("inf"))


def retire_tails(pool: tuple[torch.Tensor, torch.Tensor], host: tuple[torch.Tensor, torch.Tensor],
                 selected: torch.Tensor, selected_scores: torch.Tensor, batch: torch.Tensor, before: torch.Tensor,
                 base: int, num_heads: int, host_pages_per_row: int, page_size: int, full_only: bool = False,
                 centre: torch.Tensor | None = None) -> None:
    """Retire the full tail page of every stable row of requests ``batch``, in one launch (one program per row).

    ``full_only``: ``batch`` may list any requests; those whose tail page is not full (``before`` not a positive
    multiple of the page size) are skipped on the device (a launch whose work a CUDA graph can replay every step).

    Each row's tail slot is copied to its host page, and into the selection slot the page takes over: an empty
    slot, else the lowest-scored page other than the sink (first on ties); that slot then lists the page with
    score ``+inf``. A row whose slots hold only the sink keeps the page on the host alone.

    Args:
        pool: the layer's device ``(k, v)`` pages ``[S, ps, D]``; row ``r``'s slots are ``base + r * (K + C) + j``.
        host: the host tier ``(k, v)`` as pinned pages ``[R * P, ps, D]``, page ``p`` of row ``r`` at ``r * P + p``.
        selected, selected_scores: ``[R, K - 1 + C]`` int64 / fp32 selection state, updated in place.
        batch: ``[n]`` int64 requests whose tail is full; ``before``: ``[B]`` int64 tokens before this step.
        centre: ``[R, D]`` key centre of each row, taken off the keys the host tier stores (``None``: none).
    """
    if batch.numel() == 0:
        return
    slots_per_row = selected.shape[1]
    page, head_dim = pool[0].shape[1] * pool[0].shape[2], pool[0].shape[2]
    _retire_tails_kernel[(batch.numel() * num_heads,)](
        pool[0], pool[1], host[0], host[1], selected, selected_scores, batch, before,
        before if centre is None else centre, base, num_heads, host_pages_per_row, K=slots_per_row + 1,
        PAGE_SIZE=page_size, PAGE=page, HEAD_DIM=head_dim, BLOCK=triton.next_power_of_2(page),
        BLOCK_K=triton.next_power_of_2(slots_per_row), FULL_ONLY=full_only, CENTRED=centre is not None,
    )


@triton.jit(do_not_specialize=["batch_size", "table_width", "num_kv_heads"])
def _open_pages_kernel(table_ptr, write_slots_ptr, heads_ptr, page_ptr, offset_ptr, start_ptr, batch_size,
                       table_width, num_kv_heads, NUM_HEADS: tl.constexpr, BLOCK_B: tl.constexpr,
                       BLOCK_H: tl.constexpr):
    request = tl.program_id(0)
    if tl.load(offset_ptr + request) == 0:  # this step's token starts a new page of this request
        others = tl.arange(0, BLOCK_B)
        opening = (others < request) & (tl.load(offset_ptr + others, mask=others < batch_size, other=1) == 0)
        rank = tl.sum(opening.to(tl.int64), axis=0)  # requests before this one that open a page too
        heads = tl.arange(0, BLOCK_H)
        listed = heads < NUM_HEADS
        slots = tl.load(start_ptr) + rank * NUM_HEADS + heads
        page = tl.load(page_ptr + request)
        tl.store(table_ptr + (request * NUM_HEADS + heads) * table_width + page, slots, mask=listed)
        kv_heads = tl.load(heads_ptr + heads, mask=listed, other=0)
        tl.store(write_slots_ptr + request * num_kv_heads + kv_heads, slots, mask=listed)


def open_pages(table: torch.Tensor, write_slots: torch.Tensor, heads: torch.Tensor, page: torch.Tensor,
               offset: torch.Tensor, start: torch.Tensor) -> None:
    """Decode step: give each request whose token starts a new page (``offset == 0``) a pool slot per head, in one
    launch with no host involvement (the host reserved the slots: ``start`` is on the device).

    The ``r``-th such request (in batch order) gets slots ``start + r * h + j`` for its heads ``j``: written into
    its page table entry and as the heads' write slots.

    Args:
        table: ``[B, h, P]`` int64 page table of the ``h`` resident heads (``P`` > every ``page``).
        write_slots: ``[B, H]`` int64 slot each (request, KV head) writes its next token to.
        heads: ``[h]`` int64 KV-head index of each resident head.
        page, offset: ``[B]`` int64 page and offset of this step's token; start: ``[1]`` int64 first reserved slot.
    """
    batch_size, num_heads, width = table.shape
    _open_pages_kernel[(batch_size,)](
        table, write_slots, heads, page, offset, start, batch_size, width, write_slots.shape[1],
        NUM_HEADS=num_heads, BLOCK_B=triton.next_power_of_2(batch_size),
        BLOCK_H=triton.next_power_of_2(num_heads),
    )


@triton.jit(do_not_specialize=["num_heads", "host_pages_per_row"])
def _write_tokens_kernel(keys_ptr, values_ptr, host_k_ptr, host_v_ptr, batch_ptr, page_ptr, offset_ptr, centre_ptr,
                         num_heads, host_pages_per_row, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK: tl.constexpr, CENTRED: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, BLOCK)
    inside = dims < HEAD_DIM
    source = (token.to(tl.int64) * num_heads + head) * HEAD_DIM + dims
    row = tl.load(batch_ptr + token) * num_heads + head
    target = ((row * host_pages_per_row + tl.load(page_ptr + token)) * PAGE_SIZE + tl.load(offset_ptr + token))
    target = target * HEAD_DIM + dims
    keys = tl.load(keys_ptr + source, mask=inside)
    if CENTRED:
        centre = tl.load(centre_ptr + row * HEAD_DIM + dims, mask=inside)
        tl.store(host_k_ptr + target, keys.to(centre.dtype) - centre, mask=inside)
    else:
        tl.store(host_k_ptr + target, keys, mask=inside)
    tl.store(host_v_ptr + target, tl.load(values_ptr + source, mask=inside), mask=inside)


def write_tokens(keys: torch.Tensor, values: torch.Tensor, host: tuple[torch.Tensor, torch.Tensor],
                 batch: torch.Tensor, page: torch.Tensor, offset: torch.Tensor, host_pages_per_row: int,
                 centre: torch.Tensor | None = None) -> None:
    """Write a chunk's tokens into the pinned host tier from the device (prefill offload without a host sync).

    Args:
        keys, values: ``[N, h, D]`` the chunk's tokens of ``h`` heads, in plan order (cast to the tier's dtype).
        host: the host tier ``(k, v)`` as pinned pages ``[R * P, ps, D]``; row ``b * h + head``, page ``p`` at
            ``row * P + p``.
        batch, page, offset: ``[N]`` int64 request, page and offset of every token (device).
        centre: ``[R, D]`` key centre of each row, taken off the stored keys (``None``: none).
    """
    num_tokens, num_heads, head_dim = keys.shape
    if num_tokens == 0:
        return
    _write_tokens_kernel[(num_tokens, num_heads)](
        keys.contiguous(), values.contiguous(), host[0], host[1], batch, page, offset,
        batch if centre is None else centre, num_heads, host_pages_per_row, PAGE_SIZE=host[0].shape[1],
        HEAD_DIM=head_dim, BLOCK=triton.next_power_of_2(head_dim), CENTRED=centre is not None,
    )
