"""FlashInfer sparse paged decode: rows = (request, KV head), ``num_kv_heads=1``, one ``plan()`` per decode step.

Every row attends to ``min(K, pages)`` pages, a count that depends only on the request's length, so all layers of
one step share the plan (built from host-side lengths, no device sync). Each layer scatters its page slots into
one preallocated index buffer that the planned wrapper reads.
"""

from __future__ import annotations

import torch

from flexicache.backends.base import DecodeLayout

WORKSPACE_BYTES = 128 * 2**20
CUDA_CORE_GROUP_SIZES = (1, 2, 4, 8)  # group sizes FlashInfer's CUDA-core decode kernel is built for


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


class FlashInferBackend:
    """:class:`~flexicache.backends.base.DecodeBackend` on FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper``.

    Args:
        device: CUDA device.
        use_tensor_cores: ``None`` picks per group size (tensor cores when the CUDA-core kernel lacks the group
            size or the group is large); ``True``/``False`` forces.
    """

    name = "flashinfer"

    def __init__(self, device: torch.device, use_tensor_cores: bool | None = None) -> None:
        import flashinfer

        self.device = device
        self.use_tensor_cores = use_tensor_cores
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrappers: dict[bool, flashinfer.BatchDecodeWithPagedKVCacheWrapper] = {}
        self._flashinfer = flashinfer
        self._planned: tuple | None = None
        self._indices = torch.empty(0, dtype=torch.int32, device=device)

    def _wrapper(self, tensor_cores: bool):
        if tensor_cores not in self._wrappers:
            self._wrappers[tensor_cores] = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, kv_layout="NHD", use_tensor_cores=tensor_cores
            )
        return self._wrappers[tensor_cores]

    def _tensor_cores(self, group: int) -> bool:
        if self.use_tensor_cores is not None:
            return self.use_tensor_cores
        return group not in CUDA_CORE_GROUP_SIZES or group >= 8

    def prepare(self, layout: DecodeLayout, group: int, head_dim: int, page_size: int, dtype: torch.dtype,
                scale: float) -> torch.Tensor:
        """Plan the step (once: every layer of the step passes the same ``layout``) and return the int32 index
        buffer that each layer fills with its rows' page slots (``indices[indptr[r] + j]``) before
        :meth:`run_prepared`."""
        self._tensor_cores_now = self._tensor_cores(group)
        key = (layout, group, head_dim, page_size, dtype, scale, self._tensor_cores_now)
        if self._planned != key:
            total = int(layout.row_indptr_host[-1])
            if self._indices.numel() < total + 1:
                self._indices = torch.empty(2 * (total + 1), dtype=torch.int32, device=self.device)
            self._wrapper(self._tensor_cores_now).plan(
                layout.row_indptr_host, self._indices[:total], layout.row_last_page_len_host,
                group, 1, head_dim, page_size, q_data_type=dtype, kv_data_type=dtype, sm_scale=scale,
            )
            self._planned = key
        return self._indices

    def run_prepared(self, query: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor) -> torch.Tensor:
        """Decode ``query [R, G, D]`` over the pool ``[S, ps, D]`` with the prepared plan and indices."""
        cache = (pool_k.unsqueeze(2), pool_v.unsqueeze(2))  # [S, ps, 1, D] each (NHD, one KV head)
        return self._wrapper(self._tensor_cores_now).run(query.contiguous(), cache)

    def paged_decode(self, query: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, slots: torch.Tensor,
                     page_lens: torch.Tensor, scale: float, layout: DecodeLayout) -> torch.Tensor:
        rows, group, head_dim = query.shape
        indices = self.prepare(layout, group, head_dim, pool_k.shape[1], query.dtype, scale)
        # Compact each row's listed pages (in order, tail last) into the planned index buffer.
        listed = page_lens > 0
        rank = listed.to(torch.int32).cumsum(dim=1) - 1
        total = int(layout.row_indptr_host[-1])
        destination = torch.where(listed, layout.row_indptr[:-1].view(-1, 1) + rank, total)
        indices.scatter_(0, destination.view(-1).long(), slots.view(-1).to(torch.int32))
        return self.run_prepared(query, pool_k, pool_v)
