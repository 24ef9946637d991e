"""The interface every decode backend implements."""

from __future__ import annotations

from typing import Protocol

import torch


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
    ) -> torch.Tensor:
        """Sparse decode attention.

        Args:
            query: ``[R, G, D]``.
            pool_k, pool_v: ``[S, page_size, D]`` page pool.
            slots: ``[R, P]`` pool slot of each listed page (ignored where ``page_lens == 0``).
            page_lens: ``[R, P]`` valid tokens in each listed page (``0`` = no page, ``page_size`` = full).
            scale: softmax scale.

        Returns:
            ``[R, G, D]`` in the query's dtype.
        """
        ...
