"""The host tier's buffers: the full pages of a layer's stable heads in host memory (page-locked on CUDA)."""

from __future__ import annotations

import math

import torch

from flexicache.host_memory import anonymous_mappings, pinned_zeros
from flexicache.host_pool import host_pool


def grown_capacity(num_pages: int) -> int:
    """Pages per row a tier grown to hold ``num_pages`` gets: a quarter more (at least 64 pages) for the tokens to
    come, so that a prefill reserves its decode headroom at once."""
    return num_pages + max(64, num_pages // 4)


def pins_host_tier(device: torch.device) -> bool:
    """Whether the host tier of a cache on ``device`` is page-locked (CUDA: asynchronous copies, zero-copy kernels)."""
    return device.type == "cuda"


def to_tier_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` cast to a tier's ``dtype``; an 8-bit float tier saturates at its largest magnitude (448 for
    float8_e4m3fn, which has no inf: a plain cast gives NaN beyond it on some torch versions)."""
    if dtype.is_floating_point and dtype.itemsize == 1:
        limit = torch.finfo(dtype).max
        tensor = tensor.clamp(-limit, limit)
    return tensor.to(dtype)


class HostTier:
    """Full pages of ``h`` stable heads in host memory: ``k``/``v`` of shape ``[B, h, P, ps, D]`` (``capacity`` pages
    per row up front), in ``dtype`` (the KV's, or a narrower one: ``FlexiCacheConfig.host_dtype``; every copy to
    or from the device casts).

    ``pin_memory``: page-locked, borrowed from the process's pinned host pool (:mod:`flexicache.host_pool`, for CUDA
    copies and zero-copy kernels) and given back as soon as nothing views it; else ordinary memory. Tokens beyond those
    written are unspecified (a pooled block keeps what its previous owner wrote, NaN included): a partial tail page
    is copied to the device whole, and every reader stops at a page's length.
    """

    def __init__(self, batch_size: int, num_heads: int, page_size: int, head_dim: int, dtype: torch.dtype,
                 pin_memory: bool, capacity: int = 0) -> None:
        self.pin_memory = pin_memory
        self.k, self.v = self._buffers((batch_size, num_heads, capacity, page_size, head_dim), dtype)

    @torch.inference_mode(False)  # made outside inference mode, like every buffer a cache keeps (flexicache.storage)
    def _buffers(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``shape``: both in one block of the pinned host pool, or zeros in ordinary memory."""
        if not self.pin_memory:
            return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        if not anonymous_mappings():  # no pool without anonymous mappings: torch's pinned allocations
            return pinned_zeros(shape, dtype), pinned_zeros(shape, dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        both = host_pool().borrow(2 * nbytes).view(dtype).view(2, *shape)
        return both[0], both[1]

    def reserve(self, num_pages: int) -> None:
        """Room for ``num_pages`` pages per row (:func:`grown_capacity`: the first full page after a prefill does not
        reallocate the whole tier)."""
        if num_pages <= self.k.shape[2]:
            return
        shape = list(self.k.shape)
        shape[2] = grown_capacity(num_pages)
        # Both or neither (a refusal leaves the tier as it was), so the old and new keys and values coexist briefly.
        grown_k, grown_v = self._buffers(tuple(shape), self.k.dtype)
        grown_k[:, :, : self.k.shape[2]].copy_(self.k)
        grown_v[:, :, : self.v.shape[2]].copy_(self.v)
        self.k, self.v = grown_k, grown_v

    @property
    def nbytes_reserved(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tier as ``[B * h * P, ps, D]`` pages (keys, values): page ``p`` of row ``r`` is ``r * P + p``."""
        shape = (-1, *self.k.shape[3:])
        return self.k.view(shape), self.v.view(shape)

    def copy_from(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``keys``/``values`` ``[B, h, P, ps, D]`` (on the device, in the tier's dtype) into the first ``P``
        pages of every row: one asynchronous copy per row and tensor on the current stream (a row's pages are
        contiguous in both), the reverse of :meth:`to_device`."""
        num_pages = keys.shape[2]
        for source, tier in ((keys, self.k), (values, self.v)):
            source_rows, tier_rows = source.flatten(0, 1), tier.flatten(0, 1)  # [B * h, P, ps, D], views
            for row in range(tier_rows.shape[0]):
                tier_rows[row, :num_pages].copy_(source_rows[row], non_blocking=True)

    def to_device(self, num_pages: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``num_pages`` pages of every row as device ``[B, h, num_pages, ps, D]`` keys/values in the tier's
        dtype: one asynchronous copy per row and tensor from the page-locked tier (a row's pages are contiguous in
        it)."""
        batch_size, num_heads, capacity, page_size, head_dim = self.k.shape
        copies = []
        for pages in (self.k, self.v):
            target = torch.empty(batch_size * num_heads, num_pages, page_size, head_dim, dtype=pages.dtype,
                                 device=device)
            by_row = pages.view(batch_size * num_heads, capacity, page_size, head_dim)
            if num_pages == capacity:
                target.copy_(by_row, non_blocking=True)
            else:
                for row in range(batch_size * num_heads):
                    target[row].copy_(by_row[row, :num_pages], non_blocking=True)
            copies.append(target.view(batch_size, num_heads, num_pages, page_size, head_dim))
        return copies[0], copies[1]
