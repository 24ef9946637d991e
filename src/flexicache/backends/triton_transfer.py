"""Page copies between the pinned host tier and device pools without a host synchronisation (Triton).

Pinned host memory is mapped into the device's address space (unified addressing), so one kernel can read host
pages into device slots (promotion) or write device pages into host pages (tail retirement) straight from index
tensors that live on the device: the host never needs to know which pages move. Copies run on the current stream,
ordered with the decode kernels around them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_pages_kernel(src_k_ptr, src_v_ptr, dst_k_ptr, dst_v_ptr, src_index_ptr, dst_index_ptr, mask_ptr,
                       PAGE: tl.constexpr, BLOCK: tl.constexpr):
    item = tl.program_id(0)
    if tl.load(mask_ptr + item) != 0:
        offsets = tl.arange(0, BLOCK)
        inside = offsets < PAGE
        source = tl.load(src_index_ptr + item) * PAGE
        target = tl.load(dst_index_ptr + item) * PAGE
        tl.store(dst_k_ptr + target + offsets, tl.load(src_k_ptr + source + offsets, mask=inside), mask=inside)
        tl.store(dst_v_ptr + target + offsets, tl.load(src_v_ptr + source + offsets, mask=inside), mask=inside)


def copy_pages(source: tuple[torch.Tensor, torch.Tensor], target: tuple[torch.Tensor, torch.Tensor],
               source_index: torch.Tensor, target_index: torch.Tensor, mask: torch.Tensor) -> None:
    """``target[j][target_index[i]] = source[j][source_index[i]]`` for keys and values (``j``) where ``mask[i]``.

    Args:
        source, target: ``(k, v)`` page arrays ``[N, ps, D]`` (device memory or pinned host memory).
        source_index, target_index: ``[n]`` int64 page indices, on the device.
        mask: ``[n]`` bool, on the device.
    """
    if mask.numel() == 0:
        return
    page = source[0].shape[1] * source[0].shape[2]
    _copy_pages_kernel[(mask.numel(),)](
        source[0], source[1], target[0], target[1], source_index, target_index, mask,
        PAGE=page, BLOCK=triton.next_power_of_2(page),
    )
