"""Torch reference decode backend: gathers the listed pages and runs masked softmax attention (any device)."""

from __future__ import annotations

import torch

from flexicache.backends.base import DecodeLayout


class ReferenceBackend:
    """Plain torch implementation of :class:`~flexicache.backends.base.DecodeBackend` (fp32/fp64 math)."""

    name = "reference"

    def paged_decode(
        self,
        query: torch.Tensor,
        pool_k: torch.Tensor,
        pool_v: torch.Tensor,
        slots: torch.Tensor,
        page_lens: torch.Tensor,
        scale: float,
        layout: DecodeLayout,
    ) -> torch.Tensor:
        rows, pages = slots.shape
        page_size, head_dim = pool_k.shape[1], pool_k.shape[2]
        compute_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
        gather = slots.clamp(min=0).reshape(-1)
        keys = pool_k.index_select(0, gather).view(rows, pages * page_size, head_dim).to(compute_dtype)
        values = pool_v.index_select(0, gather).view(rows, pages * page_size, head_dim).to(compute_dtype)
        offsets = torch.arange(page_size, device=slots.device)
        valid = (offsets.view(1, 1, -1) < page_lens.unsqueeze(-1)).view(rows, 1, pages * page_size)
        logits = torch.bmm(query.to(compute_dtype), keys.transpose(1, 2)) * scale  # [R, G, P*ps]
        logits = logits.masked_fill(~valid, float("-inf"))
        weights = torch.softmax(logits, dim=-1)
        # Slots beyond a page's length hold whatever the pool or a reused host block held (NaN included): a zero
        # weight does not cancel a NaN value.
        values = values.masked_fill(~valid.view(rows, -1, 1), 0)
        return torch.bmm(weights, values).to(query.dtype)
