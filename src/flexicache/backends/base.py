"""The interface every decode backend implements, and the per-step row layout they share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(eq=False)  # compared by identity: a backend's plan is valid for one step's layout object
class DecodeLayout:
    """How many pages each row lists at one decode step; identical for every layer of that step (with
    ``head_budgets="prompt"``: for every layer of one split).

    Rows are (request, KV head) pairs, ``r = b * H + h``. Every row of request ``b`` lists ``min(K, pages_b)``
    pages (``K``: the row's own with ``head_budgets="prompt"``), the tail (``last_page_len`` tokens) last.
    """

    row_indptr_host: torch.Tensor  # [R + 1] int32, CPU
    row_last_page_len_host: torch.Tensor  # [R] int32, CPU


def build_decode_layout(num_tokens_host: torch.Tensor, num_kv_heads: int, pages_per_head: int, page_size: int,
                        row_limits: torch.Tensor | None = None) -> DecodeLayout:
    """Layout of a decode step from the real-token counts ``[B]`` (CPU) after the step's token was appended;
    ``row_limits [B * H]`` (CPU): each row's own ``K`` in place of ``pages_per_head`` (``head_budgets="prompt"``)."""
    pages = ((num_tokens_host + page_size - 1) // page_size).repeat_interleave(num_kv_heads)
    limits = torch.full_like(pages, pages_per_head) if row_limits is None else row_limits.to(pages.dtype)
    row_pages = torch.minimum(pages, limits).to(torch.int32)
    row_indptr = torch.zeros(row_pages.numel() + 1, dtype=torch.int32)
    torch.cumsum(row_pages, 0, out=row_indptr[1:])
    last_page_len = ((num_tokens_host - 1) % page_size + 1).repeat_interleave(num_kv_heads).to(torch.int32)
    return DecodeLayout(row_indptr, last_page_len)


class DecodeBackend(Protocol):
    """Attention of one query token per row over that row's listed pages of a page pool.

    A row is one (request, KV head) pair; its ``G`` query heads share the row's pages (GQA).
    """

    name: str

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
        """Sparse decode attention.

        Args:
            query: ``[R, G, D]``.
            pool_k, pool_v: ``[S, page_size, D]`` page pool.
            slots: ``[R, P]`` pool slot of each listed page (ignored where ``page_lens == 0``).
            page_lens: ``[R, P]`` valid tokens in each listed page (``0`` = not listed, ``page_size`` = full); the
                listed entries of a row are its ``layout`` page count, the tail (partial page) last.
            scale: softmax scale.
            layout: the step's row layout (shared by all layers; lets a backend plan once per step).

        Returns:
            ``[R, G, D]`` in the query's dtype.
        """
        ...


@runtime_checkable
class PreparedBackend(DecodeBackend, Protocol):
    """A decode backend that plans a step once (host side) and then decodes from fixed buffers the caller fills:
    the CUDA-graph path (:class:`~flexicache.decode_paths.GraphedDecode`) captures :meth:`run_prepared`."""

    def prepare(self, layout: DecodeLayout, group: int, head_dim: int, page_size: int, row_width: int,
                dtype: torch.dtype, scale: float, owner: object | None = None) -> Any:
        """Plan the step of ``layout`` (once per step: every layer passes the same layout; ``owner``: a layer storage
        with its own split of the pages, ``head_budgets="prompt"``, whose plan stays its own) and return its
        buffers:
        ``indices`` (int32 ``[R * row_width + 1]``, ``row_width`` the most pages a row lists; the caller writes each
        row's listed pool slots at ``indptr[r]``) and
        ``indptr`` (int32 ``[R + 1]`` on the device)."""
        ...

    def run_prepared(self, planned: Any, query: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode ``query [R, G, D]`` over the pool ``[S, ps, D]`` with ``planned`` (from :meth:`prepare`, its
        indices filled); writes ``out`` when given."""
        ...
