"""FlashInfer sparse paged decode: rows = (request, KV head), ``num_kv_heads=1``, a ``plan()`` per step and page split.

Every row attends to ``min(K, pages)`` pages, a count that depends only on the request's length, so all layers of
one step share the plan (built from host-side lengths, no device sync), and once every row is at the budget the
steps after it reuse that plan (:meth:`FlashInferBackend.prepare`). A layer with its own split of the pages across
its heads (``head_budgets="prompt"``: ``min(K_r, pages)`` per row) keeps a wrapper and plan of its own. The wrappers
run in FlashInfer's CUDA-graph mode: their index, row-offset and last-page buffers never move, so a layer's decode can
be captured once and replayed after every later plan. Each layer writes its page slots into its wrapper's index
buffer before it runs.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from flexicache.backends.base import DecodeLayout

WORKSPACE_BYTES = 128 * 2**20
CUDA_CORE_GROUP_SIZES = (1, 2, 4, 8)  # group sizes FlashInfer's CUDA-core decode kernel is built for
# Measured on the H200 (eval/gpu_kernel_sweep.py, 64 pages per row): the tensor-core kernel is 1.4-2.4x faster from
# a group of 4 at 64+ rows, about even at 16 rows; for groups 1-2 mostly slower (up to 1.5x at 16 rows; 6% faster
# for group 2 at 64 rows).
TENSOR_CORES_FROM_GROUP = 4
# FlashInfer releases whose decode plans (both kernels) were read and GPU-tested to depend on the rows' page counts
# only (tests/test_gpu_flashinfer.py): others plan at every step, which is always correct.
PLAN_REUSE_RELEASES = ("0.7.",)


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(eq=False)
class SharedLengths:
    """The device buffer of the last-page lengths that the wrappers of every split (``head_budgets="prompt"``, one
    per layer) read, and the host values last copied into it: the lengths are the same in every layer of a step."""

    buffer: torch.Tensor  # int32 [R] on the device
    loaded: torch.Tensor | None = None  # int32 [R] on the CPU

    def holds(self, lengths: torch.Tensor) -> bool:
        return self.loaded is not None and torch.equal(self.loaded, lengths)


@dataclass(eq=False)
class PlannedDecode:
    """A planned step: the wrapper and the buffers a layer fills before :meth:`FlashInferBackend.run_prepared`.

    ``indices``: int32 ``[R * W + 1]`` (``W``: the widest row's pages) pool slot of every listed page, row ``r`` at
    ``indices[indptr[r]:indptr[r+1]]`` (the last entry is a never-read dump for unlisted entries);
    ``indptr``: int32 ``[R + 1]`` on the device (written by the plan); ``last_page_len``: int32 ``[R]`` on the
    device, tokens in each row's last listed page.
    """

    wrapper: object
    indices: torch.Tensor
    indptr: torch.Tensor
    last_page_len: torch.Tensor
    planned_for: tuple | None = None  # (settings, row indptr on the CPU) of the wrapper's current plan
    plan_staged: torch.cuda.Event | None = None  # recorded after the wrapper's last plan() queued its copy
    shared_lengths: SharedLengths | None = None  # a split's wrapper: the last-page lengths it shares with the others


class FlashInferBackend:
    """:class:`~flexicache.backends.base.DecodeBackend` on FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper``.

    Args:
        device: CUDA device.
        use_tensor_cores: ``None`` picks per group size (tensor cores from a group of 4 query heads per KV head,
            and where the CUDA-core kernel lacks the group size); ``True``/``False`` forces.
    """

    name = "flashinfer"

    # One backend serves every cache of the process (flexicache.backends), whatever grad mode each runs in: the
    # tensors it keeps and writes in place (workspace, plan buffers, the wrappers' own) are made outside inference
    # mode, where in-place writes work in every mode (an inference tensor refuses them outside inference mode).
    @torch.inference_mode(False)
    def __init__(self, device: torch.device, use_tensor_cores: bool | None = None) -> None:
        import flashinfer

        self.device = device
        self.use_tensor_cores = use_tensor_cores
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._planned_steps: dict[tuple[int, int, bool], PlannedDecode] = {}
        self._owned_steps: weakref.WeakKeyDictionary[object, dict] = weakref.WeakKeyDictionary()
        self._split_last_page_len: dict[int, SharedLengths] = {}  # rows: the owned wrappers' last-page lengths
        self._flashinfer = flashinfer
        self._plan_key: tuple | None = None
        self._current: PlannedDecode | None = None
        self.reuses_plans = getattr(flashinfer, "__version__", "").startswith(PLAN_REUSE_RELEASES)

    def _tensor_cores(self, group: int) -> bool:
        if self.use_tensor_cores is not None:
            return self.use_tensor_cores
        return group not in CUDA_CORE_GROUP_SIZES or group >= TENSOR_CORES_FROM_GROUP

    def _planned_step(self, rows: int, row_width: int, tensor_cores: bool, owner: object | None = None
                      ) -> PlannedDecode:
        """The CUDA-graph-mode wrapper (and its static buffers) for ``rows`` rows of at most ``row_width`` pages: one
        per shape shared by every layer, or ``owner``'s own (a layer storage with its own split of the pages,
        ``head_budgets="prompt"``: its captured decode reads its plan at every step; dropped with the owner)."""
        steps = self._planned_steps if owner is None else self._owned_steps.setdefault(owner, {})
        key = (rows, row_width, tensor_cores)
        if key not in steps:
            with torch.inference_mode(False):
                shared = None
                if owner is not None:  # every split's wrapper reads one buffer of the step's last-page lengths
                    if rows not in self._split_last_page_len:
                        self._split_last_page_len[rows] = SharedLengths(
                            torch.zeros(rows, dtype=torch.int32, device=self.device))
                    shared = self._split_last_page_len[rows]
                steps[key] = self._new_planned_step(rows, row_width, tensor_cores, shared)
        return steps[key]

    def _new_planned_step(self, rows: int, row_width: int, tensor_cores: bool,
                          shared_lengths: SharedLengths | None = None) -> PlannedDecode:
        indptr = torch.zeros(rows + 1, dtype=torch.int32, device=self.device)
        indices = torch.zeros(rows * row_width + 1, dtype=torch.int32, device=self.device)
        last_page_len = (torch.zeros(rows, dtype=torch.int32, device=self.device) if shared_lengths is None
                         else shared_lengths.buffer)
        wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, kv_layout="NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last_page_len, backend="fa2",
        )
        return PlannedDecode(wrapper, indices, indptr, last_page_len, shared_lengths=shared_lengths)

    def prepare(self, layout: DecodeLayout, group: int, head_dim: int, page_size: int, row_width: int,
                dtype: torch.dtype, scale: float, owner: object | None = None) -> PlannedDecode:
        """Plan the step once (every layer of the step passes the same ``layout``) and return its buffers; a layer
        with its own split of the pages (``head_budgets="prompt"``) passes its storage as ``owner`` and keeps its
        own plan.

        FlashInfer's plans (both kernels) depend on the rows' page counts, not on their last pages' lengths, which
        the kernels read from the device buffer at run time (the tensor-core plan splits each row into chunks of
        whole pages, so a row's chunk count does not change with its last page either): a step whose page counts
        equal the plan's (e.g. every row at the budget) only refreshes that buffer, skipping ``plan()`` (0.3-0.9 ms
        of host time), on the FlashInfer releases where this was verified (``PLAN_REUSE_RELEASES``).
        """
        tensor_cores = self._tensor_cores(group)
        settings = (group, head_dim, page_size, row_width, dtype, scale, tensor_cores)
        key = (layout, id(owner), *settings)  # layers with equal splits share a layout, each keeps its own plan
        if self._plan_key == key:
            return self._current
        planned = self._planned_step(layout.row_last_page_len_host.numel(), row_width, tensor_cores, owner)
        same_pages = (self.reuses_plans and planned.planned_for is not None and planned.planned_for[0] == settings
                      and torch.equal(planned.planned_for[1], layout.row_indptr_host))
        shared = planned.shared_lengths
        if same_pages:
            if shared is None or not shared.holds(layout.row_last_page_len_host):  # a split's: once per step
                planned.last_page_len.copy_(layout.row_last_page_len_host.pin_memory(), non_blocking=True)
        else:
            total = int(layout.row_indptr_host[-1])
            # plan() stages its schedule in its wrapper's page-locked buffer and copies it to the device
            # asynchronously: that wrapper's last copy must have left the buffer (a plan may be made while earlier
            # steps still run).
            if planned.plan_staged is not None:
                planned.plan_staged.synchronize()
            with torch.inference_mode(False):  # plan() writes (and may first make) the wrapper's own buffers
                planned.wrapper.plan(
                    layout.row_indptr_host, planned.indices[:total], layout.row_last_page_len_host,
                    group, 1, head_dim, page_size, q_data_type=dtype, kv_data_type=dtype, sm_scale=scale,
                )
            planned.planned_for = (settings, layout.row_indptr_host)
            if self.device.type == "cuda":  # on this device's stream, where plan() queued its copy
                planned.plan_staged = planned.plan_staged or torch.cuda.Event()
                planned.plan_staged.record(torch.cuda.current_stream(self.device))
        if shared is not None:
            shared.loaded = layout.row_last_page_len_host
        self._plan_key, self._current = key, planned
        return planned

    @staticmethod
    def run_prepared(planned: PlannedDecode, query: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode ``query [R, G, D]`` over the pool ``[S, ps, D]`` with a prepared plan and filled indices."""
        cache = (pool_k.unsqueeze(2), pool_v.unsqueeze(2))  # [S, ps, 1, D] each (NHD, one KV head)
        return planned.wrapper.run(query.contiguous(), cache, out=out)

    def paged_decode(self, query: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, slots: torch.Tensor,
                     page_lens: torch.Tensor, scale: float, layout: DecodeLayout) -> torch.Tensor:
        _, group, head_dim = query.shape
        planned = self.prepare(layout, group, head_dim, pool_k.shape[1], slots.shape[1], query.dtype, scale)
        # Compact each row's listed pages (in order, tail last) into the planned index buffer.
        listed = page_lens > 0
        rank = listed.to(torch.int32).cumsum(dim=1) - 1
        dump = planned.indices.numel() - 1
        destination = torch.where(listed, planned.indptr[:-1].view(-1, 1) + rank, dump)
        planned.indices.scatter_(0, destination.view(-1).long(), slots.view(-1).to(torch.int32))
        return self.run_prepared(planned, query, pool_k, pool_v)
