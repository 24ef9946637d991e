"""The KV storage of one layer: one device page pool, the page min/max of every head, and the two head classes.

Unstable heads keep every page on the device (:class:`~flexicache.paging.ResidentPages`); stable heads keep their
working set of pages (selected and standby) and their tail page on the device and the full KV in the host tier
(:class:`~flexicache.offload.OffloadedPages`). Both share the layer's :class:`~flexicache.paging.PagePool` and its
:class:`~flexicache.paging.PageMetadata`. This module holds the buffers and the writes that follow a plan; the
kernels that read them at decode are the decode paths' (:mod:`flexicache.decode_paths`).

Shapes: ``B`` requests, ``H`` KV heads (``hu`` unstable, ``hs`` stable), ``P`` pages, ``ps`` page size, ``D`` head
dim. Rows (request, head) flatten as ``b * H + h``.

Every buffer a cache keeps across calls (here, in the decode paths' graphs and step inputs, in the step graphs and
the shared backend) is made outside inference mode: an inference tensor refuses in-place writes outside
``torch.inference_mode``, and a cache may be filled under ``inference_mode`` and decoded under ``no_grad`` or in plain
mode (or the other way round). Tensors that require grad are stored detached (``FlexiLayer`` drops their history).
"""

from __future__ import annotations

import torch

from flexicache.config import FlexiCacheConfig
from flexicache.key_basis import KeyBasis
from flexicache.offload import OffloadedPages
from flexicache.paging import PageMetadata, PagePool, ResidentPages, chunk_tokens
from flexicache.sequence import AppendPlan


class LayerStorage:
    """Device pages, page metadata and host tier of one layer's ``H`` KV heads, for a batch of ``B`` requests.

    Args:
        unstable_heads: KV heads that keep every page on the device (the others are stable).
        reserved_device_pages: device pages per row to reserve up front (``settings.reserved_pages``, from
            ``max_cache_len``, capped by the decode path); the host tier reserves ``settings.reserved_pages`` itself.
    """

    @torch.inference_mode(False)  # the buffers are kept across calls (see the module docstring)
    def __init__(self, settings: FlexiCacheConfig, unstable_heads: list[int], num_kv_heads: int, batch_size: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, reserved_device_pages: int) -> None:
        self.settings = settings
        self.num_kv_heads, self.batch_size, self.head_dim = num_kv_heads, batch_size, head_dim
        self.dtype, self.device = dtype, device
        self.unstable_heads = list(unstable_heads)
        self.stable_heads = [head for head in range(num_kv_heads) if head not in set(unstable_heads)]
        page_size, pages_per_head = settings.page_size, settings.pages_per_head
        stable_slots = pages_per_head + settings.num_standby_pages  # a stable row's working set and tail page
        self.pool = PagePool(page_size, head_dim, dtype, device, capacity=batch_size * (
            len(self.unstable_heads) * reserved_device_pages + len(self.stable_heads) * stable_slots))
        self.unstable_index = torch.tensor(self.unstable_heads, dtype=torch.long, device=device)
        self.stable_index = torch.tensor(self.stable_heads, dtype=torch.long, device=device)
        self.meta = PageMetadata(batch_size, num_kv_heads, head_dim, dtype, device, capacity=reserved_device_pages)
        # Pool slot where each (request, head) writes its next decode token: the tail page's slot.
        self.write_slots = torch.full((batch_size, num_kv_heads), -1, dtype=torch.long, device=device)
        self.resident: ResidentPages | None = None
        self.offloaded: OffloadedPages | None = None
        if self.unstable_heads:
            self.resident = ResidentPages(self.pool, batch_size, len(self.unstable_heads), page_size,
                                          reserved_device_pages)
            self.open_start = torch.zeros(1, dtype=torch.long, device=device)  # whole-step graphs' page opening
        if self.stable_heads:
            self.offloaded = OffloadedPages(self.pool, batch_size, len(self.stable_heads), pages_per_head, page_size,
                                            host_pages=settings.reserved_pages,
                                            host_dtype=settings.host_tier_dtype(dtype),
                                            standby_pages=settings.num_standby_pages)
            self.write_slots[:, self.stable_index] = self.offloaded.tail_slots()
        # Pages each row (request, head) attends to: K, or the prompt's split (head_budgets="prompt", use_row_pages).
        self.row_pages_host = torch.full((batch_size * num_kv_heads,), pages_per_head, dtype=torch.long)
        self.row_pages = self.row_pages_host.to(device)
        self.row_pages_key: tuple[int, ...] | None = None  # the split as the step's layouts are keyed (None: K)
        self.table_width = self.fewest_pages = pages_per_head  # the most and the fewest pages a row attends to
        self._room_plan: AppendPlan | None = None  # the graphed step whose room make_graphed_step_room made
        self._reserved_plan: AppendPlan | None = None  # the graphed step reserve_graphed_step took its slots for
        self._open_start_host = -1  # the first new slot written into open_start (host copy)
        self.basis: KeyBasis | None = None  # the page boxes' axes (principal_bounds), set by the first chunk

    def use_row_pages(self, pages: torch.Tensor) -> None:
        """Attend to ``pages [B, H]`` (CPU) pages per row from the next decode step on (``head_budgets="prompt"``)."""
        self.row_pages_host = pages.reshape(-1).long().clone()
        self.row_pages = self.row_pages_host.to(self.device)
        uniform = bool((self.row_pages_host == self.settings.pages_per_head).all())
        self.row_pages_key = None if uniform else tuple(self.row_pages_host.tolist())
        self.table_width, self.fewest_pages = int(self.row_pages_host.max()), int(self.row_pages_host.min())

    # ------------------------------------------------------------------------------------------------ append

    def prepare_token_slots(self, plan: AppendPlan) -> None:
        """Before a single-token append: retire full stable tails, open resident pages, grow the metadata."""
        if self.offloaded is not None and plan.full_tail_requests is not None:
            self.offloaded.retire_full_tails(plan.full_tail_requests, plan)
        if self.resident is not None and plan.num_new_pages:
            self.resident.open_pages(plan)
            self.write_slots[:, self.unstable_index] = self.resident.tail_slots(plan.after)
        self.meta.reserve(plan.max_pages_after)

    def reserve_graphed_step(self, plan: AppendPlan) -> None:
        """The host side of :meth:`prepare_token_slots` for a graphed step: :meth:`make_graphed_step_room` (unless
        made ahead), then the step's pool slots and transfer counts (host integers); the device side runs in the
        step's recorded work, every step, deciding per request on the device. Once per step (a second call with the
        same plan does nothing)."""
        if self._reserved_plan is plan:
            return
        self.make_graphed_step_room(plan)
        if self.offloaded is not None:
            self.offloaded.count_retirement(plan.num_full_tails)
        if self.resident is not None and plan.num_new_pages:
            start = self.resident.reserve_pages(plan)  # its room made: slots only, no growth
            if start != self._open_start_host:  # the pool moved on since the room was made
                self._fill_open_start(start)
        self._reserved_plan = plan

    def make_graphed_step_room(self, plan: AppendPlan) -> None:
        """Page-table, pool, metadata and host-tier room for what the graphed step ``plan`` opens and retires, and
        its first new pool slot written where the recorded work reads it: the only part of a graphed step's host
        work that can reallocate what a recorded graph reads. Safe ahead of the step, even of one that never comes
        (another chunk first): it takes no slot and counts nothing (:meth:`reserve_graphed_step` does). Once per
        plan."""
        if self._room_plan is plan:
            return
        if self.offloaded is not None:
            self.offloaded.make_retirement_room(plan.full_pages_before)
        if self.resident is not None and plan.num_new_pages:
            self.resident.make_room(plan)
            self._fill_open_start(self.resident.pool.used)
        self.meta.reserve(plan.max_pages_after)
        self._room_plan = plan

    def _fill_open_start(self, start: int) -> None:
        self.open_start.fill_(start)
        self._open_start_host = start

    def append_chunk(self, keys: torch.Tensor, values: torch.Tensor, plan: AppendPlan) -> None:
        """Append a chunk of several tokens ``[B, H, T, D]`` to both head classes following ``plan`` (with
        ``principal_bounds`` a first chunk on the empty storage also sets the page boxes' axes; a cache started token
        by token keeps the model's axes)."""
        if self.settings.principal_bounds and self.basis is None and not bool(plan.before_host.any()):
            valid = torch.zeros(keys.shape[0], keys.shape[2], dtype=torch.bool, device=keys.device)
            valid[plan.batch, plan.chunk_pos] = True
            with torch.inference_mode(False):  # kept across calls
                self.basis = KeyBasis.principal_axes(keys.detach(), valid)
        self.meta.append(chunk_tokens(keys if self.basis is None else self.basis.chunk(keys), plan), plan)
        if self.resident is not None:
            self.resident.append(chunk_tokens(keys.index_select(1, self.unstable_index), plan),
                                 chunk_tokens(values.index_select(1, self.unstable_index), plan), plan)
            self.write_slots[:, self.unstable_index] = self.resident.tail_slots(plan.after)
        if self.offloaded is not None:
            self.offloaded.append_chunk(chunk_tokens(keys.index_select(1, self.stable_index), plan),
                                        chunk_tokens(values.index_select(1, self.stable_index), plan), plan)

    def bound_token(self, keys: torch.Tensor) -> torch.Tensor:
        """One token per row, ``keys [B, H, D]``, in the axes of the page boxes (as it is without a basis)."""
        return keys if self.basis is None else self.basis.token(keys)

    def bound_rows(self, query: torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
        """Queries ``[B * h, G, D]`` of KV heads ``heads`` (``None``: all) in the axes of the page boxes."""
        return query if self.basis is None else self.basis.rows(query, heads)

    def group_queries(self, query: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """``[B * h, G, D]`` queries of the KV heads ``heads`` from ``query [B, Hq, D]``."""
        batch_size, num_query_heads, head_dim = query.shape
        grouped = query.view(batch_size, self.num_kv_heads, num_query_heads // self.num_kv_heads, head_dim)
        return grouped.index_select(1, heads).flatten(0, 1)

    # ------------------------------------------------------------------------------------------- read back

    def read_logical(self, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every stored token read back exactly, in logical positions: ``[B, H, L, D]`` (padding is zero).

        Args:
            valid: ``[B, L]`` bool (CPU), which of the ``L`` stored logical positions hold real tokens.
        """
        num_tokens = valid.sum(dim=1).cpu()
        page_size = self.settings.page_size
        num_pages = int((num_tokens.max() + page_size - 1) // page_size) if num_tokens.numel() else 0
        shape = (self.batch_size, self.num_kv_heads, num_pages * page_size, self.head_dim)
        keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        values = torch.zeros_like(keys)
        if self.resident is not None and num_pages:
            keys[:, self.unstable_index], values[:, self.unstable_index] = self.resident.read_tokens(num_pages)
        if self.offloaded is not None and num_pages:
            keys[:, self.stable_index], values[:, self.stable_index] = self.offloaded.read_tokens(num_pages,
                                                                                                  num_tokens)
        logical_shape = (self.batch_size, self.num_kv_heads, valid.shape[1], self.head_dim)
        dense_keys = torch.zeros(logical_shape, dtype=self.dtype, device=self.device)
        dense_values = torch.zeros_like(dense_keys)
        batch, position = valid.nonzero(as_tuple=True)
        rank = (valid.long().cumsum(dim=1) - 1)[batch, position]
        dense_keys[batch, :, position] = keys[batch, :, rank]
        dense_values[batch, :, position] = values[batch, :, rank]
        return dense_keys, dense_values

    # ----------------------------------------------------------------------------------------------- bytes

    def byte_counts(self, num_tokens_host: torch.Tensor) -> dict[str, int]:
        """``device_kv_bytes``, ``device_metadata_bytes``, ``device_reserved_bytes``, ``host_kv_bytes`` and
        ``host_reserved_bytes`` of requests holding ``num_tokens_host [B]`` real tokens (see ``FlexiCache.stats``)."""
        page_size = self.settings.page_size
        page_bytes = 2 * page_size * self.head_dim * self.dtype.itemsize  # K + V
        used_pages = int(((num_tokens_host + page_size - 1) // page_size).sum())
        basis_bytes = 0 if self.basis is None else self.basis.nbytes
        counts = {  # in use (pages of the requests' real tokens) and reserved (capacity included)
            "device_kv_bytes": 0, "device_metadata_bytes": used_pages * self.num_kv_heads * page_bytes // page_size
            + basis_bytes,
            "device_reserved_bytes": self.pool.nbytes_reserved + self.meta.nbytes + basis_bytes,
            "host_kv_bytes": 0, "host_reserved_bytes": 0,
        }
        if self.resident is not None:
            counts["device_kv_bytes"] += used_pages * len(self.unstable_heads) * page_bytes
        if self.offloaded is not None:
            counts["device_kv_bytes"] += self.offloaded.nbytes_reserved
            counts["host_kv_bytes"] += self.offloaded.host_page_bytes(used_pages * len(self.stable_heads))
            counts["host_reserved_bytes"] += self.offloaded.host.nbytes_reserved
        return counts
