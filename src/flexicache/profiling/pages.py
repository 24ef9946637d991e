"""Per-page element-wise key min / max (the metadata the Quest score needs), in one shot or kept up to date, and the
true attention mass per page of the prompt's last queries (what the prompt's page split and the head split read)."""

from __future__ import annotations

import math

import torch

QUERY_BLOCK = 16  # queries per attention block (bounds the [Hq, block, T] logits of a long prompt)


def page_bounds(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise key min / max of every page: ``keys [..., T, D]`` -> ``(kmin, kmax)`` each ``[..., P, D]``."""
    length, dim = keys.shape[-2:]
    num_pages = math.ceil(length / page_size)
    pad = num_pages * page_size - length
    shape = (*keys.shape[:-2], num_pages, page_size, dim)
    if pad == 0:  # whole pages: a view, no padded copies
        pages = keys.reshape(shape)
        return pages.amin(dim=-2), pages.amax(dim=-2)
    low = torch.nn.functional.pad(keys, (0, 0, 0, pad), value=float("inf")).reshape(shape)
    high = torch.nn.functional.pad(keys, (0, 0, 0, pad), value=float("-inf")).reshape(shape)
    return low.amin(dim=-2), high.amax(dim=-2)


BMM_TAKES_OUT_DTYPE = torch.torch_version.TorchVersion(torch.__version__) >= (2, 8)  # 16-bit in, float32 out


def on_tensor_cores(key: torch.Tensor) -> bool:
    """Whether :func:`page_attention_mass` multiplies ``key`` as it is (16-bit on CUDA), not in float32."""
    return BMM_TAKES_OUT_DTYPE and key.is_cuda and key.dtype in (torch.bfloat16, torch.float16)


def page_attention_mass(query: torch.Tensor, key: torch.Tensor, first_position: int,
                        page_size: int) -> torch.Tensor:
    """``[H, w, P]`` float32: each query's causal attention mass per page of ``key`` (each query head's softmax share
    with the scale ``head_dim ** -0.5``, averaged over the GQA group), from ``query [Hq, w, D]`` at the positions
    ``first_position .. first_position + w - 1`` and ``key [H, T, D]`` (pages of ``page_size`` from position 0; the
    last may be partial). 16-bit inputs on CUDA are multiplied on tensor cores into float32 logits (their products are
    exact in float32, so the logits are float32's up to the order of the sums); other inputs in float32."""
    num_heads, length, head_dim = key.shape
    width = query.shape[1]
    block = query.reshape(num_heads, -1, head_dim)  # [H, G * w, D]: a KV head's query heads one after the other
    if on_tensor_cores(key):
        logits = torch.bmm(block, key.transpose(1, 2), out_dtype=torch.float32)
    else:
        logits = torch.bmm(block.float(), key.float().transpose(1, 2))
    logits = logits.view(num_heads, -1, width, length).mul_(head_dim ** -0.5)  # [H, G, w, T]
    future = first_position + 1  # query i sees the columns up to first_position + i
    if future < length:
        columns = torch.arange(length - future, device=key.device)
        logits[..., future:].masked_fill_(columns >= torch.arange(width, device=key.device).view(-1, 1), float("-inf"))
    shares = logits.softmax(dim=-1).mean(dim=1)  # [H, w, T]
    full = length // page_size * page_size
    mass = shares[..., :full].unflatten(-1, (-1, page_size)).sum(dim=-1)
    if full < length:  # the partial last page, padded to a whole one (the sum's order of the whole pages)
        last = torch.nn.functional.pad(shares[..., full:], (0, full + page_size - length))
        mass = torch.cat([mass, last.sum(dim=-1, keepdim=True)], dim=-1)
    return mass


def tail_page_mass(query: torch.Tensor, keys: torch.Tensor, real_tokens: torch.Tensor | None, page_size: int,
                   window: int) -> list[torch.Tensor]:
    """Per request, ``[H, W_b, P_b]`` float32: the attention mass per page (:func:`page_attention_mass`) of its last
    ``W_b = min(window, n_b, T')`` real prompt positions over its ``n_b`` real tokens, pages counted from its first
    real token (``P_b = ceil(n_b / page_size)``; ``W_b = 0`` where the queries hold none of its real tokens).

    Args:
        query: ``[B, Hq, T', D]`` the chunk's last ``T' <= T`` queries (RoPE applied).
        keys: ``[B, H, T, D]`` the chunk's keys.
        real_tokens: ``[B, T]`` bool (``None``: all real; with padding each request's real tokens are gathered,
            which syncs with the device per request).
    """
    batch, num_heads, length, _ = keys.shape
    masses = []
    for request in range(batch):
        request_keys, request_query = keys[request], query[request]
        if real_tokens is not None:
            real = real_tokens[request].to(keys.device)
            request_keys, request_query = request_keys[:, real], request_query[:, real[length - query.shape[2]:]]
        count, queries = request_keys.shape[1], min(window, request_query.shape[1])
        tail = request_query[:, request_query.shape[1] - queries:]  # [Hq, W, D]
        if not on_tensor_cores(request_keys):  # converted once, not per block
            request_keys, tail = request_keys.float(), tail.float()
        blocks = [page_attention_mass(tail[:, start:start + QUERY_BLOCK], request_keys, count - queries + start,
                                      page_size)
                  for start in range(0, queries, QUERY_BLOCK)]
        masses.append(torch.cat(blocks, dim=1) if blocks else
                      keys.new_zeros(num_heads, 0, -(-count // page_size), dtype=torch.float32))
    return masses


class PageBounds:
    """Per-page key min / max ``[..., P, D]`` (any leading dims, e.g. ``[L, B, H]``), kept up to date on append."""

    def __init__(self, keys: torch.Tensor, page_size: int, capacity_tokens: int = 0) -> None:
        """Start from the keys ``[..., T, D]`` already cached; room for ``capacity_tokens`` before regrowing."""
        capacity = math.ceil(max(capacity_tokens, keys.shape[-2], 1) / page_size)
        low, high = page_bounds(keys, page_size)
        self.page_size = page_size
        self.num_tokens = keys.shape[-2]
        self.kmin = keys.new_empty(*keys.shape[:-2], capacity, keys.shape[-1])
        self.kmax = torch.empty_like(self.kmin)
        self.kmin[..., : low.shape[-2], :] = low
        self.kmax[..., : high.shape[-2], :] = high

    @property
    def num_pages(self) -> int:
        return math.ceil(self.num_tokens / self.page_size)

    def append(self, key: torch.Tensor) -> None:
        """Add one token's keys ``[..., D]``: open a new page or widen the tail page's bounds."""
        page = self.num_tokens // self.page_size
        if page == self.kmin.shape[-2]:
            self.kmin = torch.cat([self.kmin, torch.empty_like(self.kmin)], dim=-2)
            self.kmax = torch.cat([self.kmax, torch.empty_like(self.kmax)], dim=-2)
        if self.num_tokens % self.page_size == 0:
            self.kmin[..., page, :] = key
            self.kmax[..., page, :] = key
        else:
            self.kmin[..., page, :] = torch.minimum(self.kmin[..., page, :], key)
            self.kmax[..., page, :] = torch.maximum(self.kmax[..., page, :], key)
        self.num_tokens += 1

    def bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kmin, kmax)``, each ``[..., num_pages, D]`` (views)."""
        return self.kmin[..., : self.num_pages, :], self.kmax[..., : self.num_pages, :]
