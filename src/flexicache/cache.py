"""``FlexiCache``: a transformers cache with sparse per-head top-K page attention at decode.

Each decoder layer is a :class:`FlexiLayer` holding its KV heads in two classes (from a :class:`HeadProfile`):
unstable heads keep every page on the device (:class:`~flexicache.paging.ResidentPages`) and rerank every decode
step; stable heads keep only their selected pages plus the tail page on the device, the full KV in the host tier
(:class:`~flexicache.offload.OffloadedPages`), and rerank every ``rerank_interval`` steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from flexicache import attention, parallel
from flexicache.backends import (
    DecodeBackend,
    DecodeLayout,
    ReferenceBackend,
    build_decode_layout,
    flashinfer_unsupported,
    require_flashinfer_support,
    resolve_backend,
    triton_available,
)
from flexicache.config import FlexiCacheConfig
from flexicache.decode_graph import DecodeGraph, StepInputs
from flexicache.offload import OffloadedPages, TransferCounters
from flexicache.paging import PageMetadata, PagePool, ResidentPages, chunk_tokens, grown_size
from flexicache.profile import HeadProfile, model_shape
from flexicache.selection import quest_page_scores, select_pages
from flexicache.sequence import AppendPlan, SequenceState, host_to_device, per_row
from flexicache.step_graph import StepGraphStore, enable_step_graphs

if TYPE_CHECKING:
    from flexicache.backends.triton_select import TableInputs


def layer_backend(backends: dict[torch.device, DecodeBackend], name: str, device: torch.device, dtype: torch.dtype,
                  head_dim: int) -> DecodeBackend:
    """The decode backend of a layer with KV of ``dtype`` and ``head_dim`` on ``device``: the one ``backends`` holds
    for the device (resolved by its first layer and shared, so the plan is made once per step), unless that one is
    FlashInfer and cannot decode this layer's KV (a model whose layers differ): then this layer's own fallback."""
    backend = backends.get(device)
    if backend is None:
        backend = backends[device] = resolve_backend(name, device, dtype, head_dim)
    elif (device.type == "cuda" and not isinstance(backend, ReferenceBackend)
          and flashinfer_unsupported(dtype, head_dim) is not None):
        backend = resolve_backend(name, device, dtype, head_dim)
    return backend


class FlexiLayer(CacheLayerMixin):
    """One decoder layer's KV: resident (unstable) heads, offloaded (stable) heads, and their page metadata."""

    is_sliding = False
    is_croppable = True

    def __init__(self, layer_idx: int, settings: FlexiCacheConfig, unstable_heads: list[int], num_kv_heads: int,
                 sequence: SequenceState, backends: dict[torch.device, DecodeBackend],
                 step_inputs: dict[torch.device, StepInputs] | None = None) -> None:
        super().__init__()
        self.backends = backends  # shared by the cache's layers: one backend (and plan) per device
        self.step_inputs = {} if step_inputs is None else step_inputs  # shared: per-step values per device
        self.layer_idx = layer_idx
        self.settings = settings
        self.num_kv_heads = num_kv_heads
        self.unstable_heads = list(unstable_heads)
        self.stable_heads = [head for head in range(num_kv_heads) if head not in set(unstable_heads)]
        self.sequence = sequence
        self.recording = False  # True while a whole-step graph records a forward (FlexiCache.recording)
        self._clear()

    def _clear(self) -> None:
        self.is_initialized = False
        self.logical_length = 0  # logical positions seen by update(), padding included
        self.committed_length = 0  # logical positions stored in pages
        self.num_chunks = 0
        self.plan: AppendPlan | None = None
        self.resident: ResidentPages | None = None
        self.offloaded: OffloadedPages | None = None
        self.unstable_counters = TransferCounters()
        self.decode_steps = 0
        self.scale: float | None = None  # the attention's softmax scale, seen at the first decode step

    # ------------------------------------------------------------------------------------------ storage set-up

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch_size, num_heads, _, head_dim = key_states.shape
        if num_heads != self.num_kv_heads:
            raise ValueError(
                f"Layer {self.layer_idx} received {num_heads} KV heads but the HeadProfile/config has "
                f"{self.num_kv_heads}; build the cache from this model's config (under tensor parallelism with "
                "FlexiCache.from_model(model), which keeps this rank's KV heads)."
            )
        self.device, self.dtype = key_states.device, key_states.dtype
        self.batch_size, self.head_dim = batch_size, head_dim
        self.backend = layer_backend(self.backends, self.settings.backend, self.device, self.dtype, head_dim)
        page_size, pages_per_head = self.settings.page_size, self.settings.pages_per_head
        # The Triton kernels hold a head in one power-of-two block (tl.arange); other head dims use torch ops.
        self.fused_table = self.device.type == "cuda" and triton_available() and head_dim & (head_dim - 1) == 0
        reserved = self._reserved_pages()
        self.pool = PagePool(page_size, head_dim, self.dtype, self.device, capacity=batch_size * (
            len(self.unstable_heads) * reserved + len(self.stable_heads) * pages_per_head))
        self.unstable_index = torch.tensor(self.unstable_heads, dtype=torch.long, device=self.device)
        self.stable_index = torch.tensor(self.stable_heads, dtype=torch.long, device=self.device)
        self.meta = PageMetadata(batch_size, self.num_kv_heads, head_dim, self.dtype, self.device, capacity=reserved)
        # Pool slot where each (request, head) writes its next decode token: the tail page's slot.
        self.write_slots = torch.full((batch_size, self.num_kv_heads), -1, dtype=torch.long, device=self.device)
        if self.unstable_heads:
            self.resident = ResidentPages(self.pool, batch_size, len(self.unstable_heads), page_size, reserved)
            self.open_start = torch.zeros(1, dtype=torch.long, device=self.device)  # whole-step graphs' page opening
        if self.stable_heads:
            self.offloaded = OffloadedPages(self.pool, batch_size, len(self.stable_heads), pages_per_head, page_size,
                                            host_pages=self.settings.reserved_pages)
            self.write_slots[:, self.stable_index] = self.offloaded.tail_slots()
        self.graph: DecodeGraph | None = None  # built at the first decode step on the CUDA + FlashInfer path
        self._launch: tuple | None = None  # (what it reads, launch, storage key) of the last _graph_step
        self._reserved_plan: AppendPlan | None = None  # the graphed step whose room reserve_graphed_step made
        self.is_initialized = True

    def _reserved_pages(self) -> int:
        """Device pages per row to reserve up front (``max_cache_len``'s), no more than the fused selection holds
        on the CUDA path (a longer row there takes the torch path, reserved or not)."""
        reserved = self.settings.reserved_pages
        if self.fused_table:
            from flexicache.backends.triton_select import MAX_SCORED_PAGES

            reserved = min(reserved, MAX_SCORED_PAGES)
        return reserved

    # ------------------------------------------------------------------------------------ transformers protocol

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage the new tokens for the flexicache attention; return the keys/values dense attention would need.

        Args:
            key_states, value_states: ``[B, H, T, D]`` (RoPE applied).

        Returns:
            The new tokens for a prefill or a decode step; past (read back from the pages) + new for several
            tokens on a non-empty cache, ``[B, H, L + T, D]``.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.recording:  # a whole-step graph capture: begin_graphed_step did this step's bookkeeping
            attention.stage(attention.StagedChunk(self, self.layer_idx, key_states, value_states,
                                                  self.logical_length - 1))
            return key_states, value_states
        start = self.logical_length
        attention.stage(attention.StagedChunk(self, self.layer_idx, key_states, value_states, start))
        self.logical_length += key_states.shape[2]
        if start == 0 or key_states.shape[2] == 1:
            return key_states, value_states
        past_keys, past_values = self.read_logical()
        return torch.cat([past_keys, key_states], dim=2), torch.cat([past_values, value_states], dim=2)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.logical_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.logical_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._clear()

    # ----------------------------------------------------------------------------------------- append & decode

    def commit(self, chunk: attention.StagedChunk, query: torch.Tensor, real_tokens: torch.Tensor | None) -> None:
        """Write a staged chunk of several tokens (or a first token) into pages (padding skipped); rerank the
        stable heads after it.

        Args:
            query: ``[B, Hq, T, D]`` queries of the chunk (the last one seeds the stable heads' selection).
            real_tokens: ``[B, T]`` bool or ``None`` (all real).
        """
        keys, values = chunk.keys, chunk.values
        plan = self.sequence.plan_chunk(self.num_chunks, real_tokens, keys.shape[0], keys.shape[2], self.device)
        self.append(keys, values, plan)
        if self.offloaded is not None:
            width = self._full_page_width(plan)
            if width:
                self._rerank_stable(self._group_queries(query[:, :, -1], self.stable_index), plan.after, width)
                self.offloaded.counters.reranks += self.offloaded.num_rows
            # Stagger: layer l reranks at decode steps where (step + l) % interval == 0, so no step pays them all.
            self.offloaded.steps_since_rerank = self.layer_idx % self.settings.rerank_interval

    def append(self, keys: torch.Tensor, values: torch.Tensor, plan: AppendPlan) -> None:
        """Append a chunk ``[B, H, T, D]`` to both head classes following ``plan``."""
        if plan.is_single_token:
            self._prepare_token_slots(plan)
            self._write_token(keys[:, :, 0], values[:, :, 0], plan)
        else:
            self.meta.append(chunk_tokens(keys, plan), plan)
            if self.resident is not None:
                self.resident.append(chunk_tokens(keys.index_select(1, self.unstable_index), plan),
                                     chunk_tokens(values.index_select(1, self.unstable_index), plan), plan)
                self.write_slots[:, self.unstable_index] = self.resident.tail_slots(plan.after)
            if self.offloaded is not None:
                self.offloaded.append_chunk(chunk_tokens(keys.index_select(1, self.stable_index), plan),
                                            chunk_tokens(values.index_select(1, self.stable_index), plan), plan)
        self._advance(plan, keys.shape[2])

    def _advance(self, plan: AppendPlan, num_tokens: int) -> None:
        self.plan = plan
        self.num_chunks += 1
        self.committed_length += num_tokens

    def _prepare_token_slots(self, plan: AppendPlan, in_graph: bool = False) -> None:
        """Before a single-token append: retire full stable tails, open resident pages, grow the metadata.

        ``in_graph``: only the host side (room in the host tier, pool slots, transfer counts); the device side
        runs in :meth:`_record_decode`, every step, deciding per request on the device.
        """
        if self.offloaded is not None:
            if in_graph:
                pages, full = self._per_step(plan, "retirement", lambda: (
                    int(plan.before_host.max()) // plan.page_size, int(_full_tails(plan).sum())))
                self.offloaded.prepare_retirement(pages, full)
            else:
                full = self._per_step(plan, "full_tails", lambda: _requests_with_full_tail(plan, self.device))
                if full is not None:
                    self.offloaded.retire_full_tails(full, plan)
        if self.resident is not None and plan.num_new_pages:
            if in_graph:
                self.open_start.fill_(self.resident.reserve_pages(plan))
            else:
                self.resident.open_pages(plan)
                self.write_slots[:, self.unstable_index] = self.resident.tail_slots(plan.after)
        self.meta.reserve(self._per_step(plan, "max_pages", lambda: plan.max_pages_after))

    def _write_token(self, keys: torch.Tensor, values: torch.Tensor, plan: AppendPlan) -> None:
        """Write one token per request and head (``[B, H, D]``) into its tail page's slot and page min/max."""
        if self.fused_table:
            from flexicache.backends.triton_select import append_token

            append_token(keys, values, self.pool.k, self.pool.v, self.meta.kmin, self.meta.kmax, self.write_slots,
                         plan.page, plan.offset)
            return
        self.meta.append(keys, plan)
        offsets = self._per_step(plan, "token_offsets", lambda: per_row(plan.offset, self.num_kv_heads))
        slots = self.write_slots.view(-1)
        self.pool.k[slots, offsets] = keys.reshape(-1, self.head_dim).to(self.dtype)
        self.pool.v[slots, offsets] = values.reshape(-1, self.head_dim).to(self.dtype)

    def _per_step(self, plan: AppendPlan, name: str, compute: Callable[[], Any]) -> Any:
        """A value derived from the step's plan, computed by the first layer on this device and shared."""
        key = (name, self.device, self.num_kv_heads)
        if key not in plan.memo:
            plan.memo[key] = compute()
        return plan.memo[key]

    def _group_queries(self, query: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """``[B * h, G, D]`` queries of the KV heads ``heads`` from ``query [B, Hq, D]``."""
        batch_size, num_query_heads, head_dim = query.shape
        grouped = query.view(batch_size, self.num_kv_heads, num_query_heads // self.num_kv_heads, head_dim)
        return grouped.index_select(1, heads).flatten(0, 1)

    def _full_page_width(self, plan: AppendPlan) -> int:
        """Full pages of the longest request after ``plan`` (the score width a stable rerank needs)."""
        return self._per_step(plan, "full_page_width", lambda: int(
            (plan.after_host - 1).clamp(min=0).max()) // self.settings.page_size)

    def _rerank_stable(self, query: torch.Tensor, num_tokens: torch.Tensor, width: int) -> None:
        """Rerank every stable row with ``query [B * hs, G, D]`` over its full pages (the tail page is not read).

        Device work only. ``num_tokens``: ``[B]`` real tokens per request (device); ``width``: pages scored per
        row, at least the longest row's full pages (columns beyond a row's full pages are ignored).
        """
        full_pages = (num_tokens - 1).clamp(min=0) // self.settings.page_size
        if self.fused_table:  # one kernel reading the min/max in place (the torch path gathers and upcasts them)
            from flexicache.backends.triton_select import stable_page_scores

            scores = stable_page_scores(query, self.meta.kmin, self.meta.kmax, num_tokens, self.stable_index, width,
                                        self.settings.page_size, self.settings.group_reduce)
        else:
            kmin, kmax = self.meta.rows(self.stable_index, width)
            scores = quest_page_scores(query, kmin, kmax, self.settings.group_reduce)
        self.offloaded.rerank(scores, per_row(full_pages, len(self.stable_heads)))

    def _count_decode_step(self, plan: AppendPlan) -> int:
        """Host bookkeeping of a decode step: step and rerank counters, the stable heads' rerank phase.

        Returns the score width of this step's stable rerank (``0``: none due, or no full page yet).
        """
        self.decode_steps += 1
        if self.resident is not None:
            self.unstable_counters.reranks += self.batch_size * len(self.unstable_heads)
        if self.offloaded is None:
            return 0
        self.offloaded.steps_since_rerank += 1
        if self.offloaded.steps_since_rerank < self.settings.rerank_interval:
            return 0
        self.offloaded.steps_since_rerank = 0
        width = self._full_page_width(plan)
        if width:
            self.offloaded.counters.reranks += self.offloaded.num_rows
        return width

    def decode(self, chunk: attention.StagedChunk, query: torch.Tensor, scale: float) -> torch.Tensor:
        """One decode token: append it, rerank the rows that are due, attend over each row's selected pages.

        Unstable and stable rows list their pages in one ``[B * H, K]`` table over the layer's pool, so the
        backend runs once per layer with the step's shared layout. On CUDA with FlashInfer and Triton the token
        append, scoring, selection and decode are one captured CUDA graph (:class:`DecodeGraph`).

        Args:
            query: ``[B, Hq, 1, D]``; the chunk's keys/values: ``[B, H, 1, D]``.

        Returns:
            ``[B, 1, Hq, D]``.
        """
        batch_size, num_query_heads, _, head_dim = query.shape
        rows_query = query.reshape(batch_size * self.num_kv_heads, num_query_heads // self.num_kv_heads, head_dim)
        if self.recording:
            output = self._record_decode(chunk, query, rows_query)
            return output.view(batch_size, num_query_heads, head_dim).unsqueeze(1)
        self.scale = scale
        plan = self.sequence.plan_chunk(self.num_chunks, None, batch_size, 1, self.device)
        self._prepare_token_slots(plan)
        rerank_width = self._count_decode_step(plan)
        if rerank_width:  # reads full pages only, so it may run before the token is written
            self._rerank_stable(self._group_queries(query[:, :, 0], self.stable_index), plan.after, rerank_width)
        keys, values = chunk.keys[:, :, 0], chunk.values[:, :, 0]
        if self._graph_ready(rows_query):
            output = self._decode_graphed(keys, values, rows_query, plan)
        else:
            self._write_token(keys, values, plan)
            output = self._decode_eager(rows_query, plan, scale)
        self._advance(plan, 1)
        return output.view(batch_size, num_query_heads, head_dim).unsqueeze(1)

    # ---------------------------------------------------------------------------------- whole-step CUDA graphs

    def graphed_step_ready(self, next_pages: int) -> bool:
        """Whether this layer's next decode step can be recorded into a whole-step CUDA graph: it ran a decode
        step on the CUDA graph path before (static buffers, scale and compiled kernels exist) and the fused
        selection still fits once the next token's page is reserved (``next_pages``: the longest request's pages
        after one more token)."""
        if not (self.is_initialized and self.graph is not None and self.scale is not None and self.settings.cuda_graphs
                and (self.offloaded is None or self.offloaded.zero_copy)):  # torch transfers wait for the device
            return False
        return _selection_fits_after_growth(self.meta.kmin.shape[2], next_pages)

    def begin_graphed_step(self) -> tuple:
        """Host side of a decode step whose device work a whole-step graph replays (:mod:`flexicache.step_graph`).

        Does what ``update`` and :meth:`decode` do on the host (token counts, pool slots and host-tier room for the
        pages the step opens and retires, counters, the FlashInfer plan, the step's static inputs) and prepares
        :meth:`_record_decode`.

        Returns:
            The key of the recorded work: whether the stable heads rerank, and the storage it reads.
        """
        plan = self.graphed_step_plan()
        self.reserve_graphed_step(plan)
        self._recorded_rerank = self.rerank_due(plan)
        self._recorded_launch, storage_key = self._graph_launch(plan)
        self.finish_graphed_step(plan)
        return self._recorded_rerank, storage_key

    def graphed_step_plan(self) -> AppendPlan:
        """The plan of this layer's next single-token step (computed once per step, shared by the layers)."""
        return self.sequence.plan_chunk(self.num_chunks, None, self.batch_size, 1, self.device)

    def reserve_graphed_step(self, plan: AppendPlan) -> None:
        """Pool slots, page-table, metadata and host-tier room for what the step ``plan`` opens and retires (once
        per step: a second call with the same plan does nothing). The only part of a graphed step's host work
        that can reallocate what a recorded graph reads."""
        if self._reserved_plan is not plan:
            self._prepare_token_slots(plan, in_graph=True)
            self._reserved_plan = plan

    def rerank_due(self, plan: AppendPlan) -> bool:
        """Whether the stable heads rerank at the step ``plan`` (no state change)."""
        return (self.offloaded is not None and self.offloaded.steps_since_rerank + 1 >= self.settings.rerank_interval
                and self._full_page_width(plan) > 0)

    def finish_graphed_step(self, plan: AppendPlan) -> None:
        """The host bookkeeping of a graphed step that no device work reads (lengths, counters, rerank phase): may
        run while the GPU replays the step."""
        self.logical_length += 1
        self._count_decode_step(plan)
        self._advance(plan, 1)

    def graph_storage_key(self, plan: AppendPlan) -> tuple:
        """The storage a recorded decode of the step ``plan`` reads (see :meth:`begin_graphed_step`)."""
        return self._graph_launch(plan)[1]

    def _graph_launch(self, plan: AppendPlan) -> tuple[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
                                                       tuple]:
        launch, storage_key = self._graph_step(plan)
        if self.offloaded is not None:  # what the rerank reads and writes besides the launch's storage
            offloaded = self.offloaded
            storage_key += tuple((t.data_ptr(), t.shape) for t in (
                offloaded.host.k, offloaded.host.v, offloaded.selected, offloaded.selected_scores))
        return launch, storage_key

    def _record_decode(self, chunk: attention.StagedChunk, query: torch.Tensor, rows_query: torch.Tensor
                       ) -> torch.Tensor:
        """The device work of a decode step prepared by :meth:`begin_graphed_step`, host-state free: every
        per-step value comes from static buffers, so a graph of it replays correctly at later steps. Tail
        retirement and page opening run at every step and act where this step's token starts a page."""
        from flexicache.backends.triton_transfer import open_pages

        step = self.step_inputs[self.device]
        if self.offloaded is not None:
            self.offloaded.retire_full_tails_on_device(step.before)
        if self.resident is not None:
            open_pages(self.resident.table, self.write_slots, self.unstable_index, step.page, step.offset,
                       self.open_start)
        if self._recorded_rerank:  # scores the metadata's whole capacity: a width that does not change per step
            self._rerank_stable(self._group_queries(query[:, :, 0], self.stable_index), step.num_tokens,
                                self.meta.kmin.shape[2])
        # The recorded step's own tensors are static inside its graph: no copy into the layer's buffers.
        self._recorded_launch(chunk.keys[:, :, 0], chunk.values[:, :, 0], rows_query.contiguous())
        return self.graph.output

    def _graph_ready(self, rows_query: torch.Tensor) -> bool:
        """Whether this step runs through the :class:`DecodeGraph` path (built here at the first such step)."""
        if not (self._fused_table_fits() and hasattr(self.backend, "prepare")):
            return False
        if self.graph is None:
            self.graph = DecodeGraph(self.batch_size, self.num_kv_heads, rows_query.shape[1], self.head_dim,
                                     self.dtype, self.device, capture=self.settings.cuda_graphs)
        return True

    def _decode_graphed(self, keys: torch.Tensor, values: torch.Tensor, rows_query: torch.Tensor,
                        plan: AppendPlan) -> torch.Tensor:
        launch, storage_key = self._graph_step(plan)
        graph = self.graph
        graph.load(keys, values, rows_query)
        return graph.run(lambda: launch(graph.keys, graph.values, graph.query), storage_key)

    def _device_step(self, plan: AppendPlan) -> tuple[Any, StepInputs]:
        """The step's inputs on the device, shared by the layers of a device (the first layer's call makes them):
        the backend's plan (FlashInfer) and the :class:`StepInputs`."""
        planned = self.backend.prepare(self._decode_layout(plan), self.graph.query.shape[1], self.head_dim,
                                       self.settings.page_size, self.settings.pages_per_head, self.dtype, self.scale)
        if self.device not in self.step_inputs:
            self.step_inputs[self.device] = StepInputs(self.batch_size, self.device)
        return planned, self.step_inputs[self.device].load(plan)

    def prepare_device_step(self, plan: AppendPlan) -> bool:
        """:meth:`_device_step` for ``plan``; returns whether its buffers are those this layer's last recorded
        launch reads (``False``: a graph recorded before would read stale ones)."""
        planned, step = self._device_step(plan)
        return self._launch is not None and self._launch[0][0] is planned and self._launch[0][1] is step

    def _graph_step(self, plan: AppendPlan) -> tuple[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
                                                     tuple]:
        """This step's device work (token append, scoring, selection, sparse FlashInfer decode into the layer's
        :class:`DecodeGraph` output), called with the step's keys/values ``[B, H, D]`` and contiguous query
        ``[B * H, G, D]``, and the key of the storage it reads; plans the step (once per step)."""
        from flexicache.backends.triton_select import append_token, decode_table, scores_buffer

        graph = self.graph
        planned, step = self._device_step(plan)
        # Reuse the last step's launch while nothing it reads was replaced (the tuple keeps those objects alive,
        # so an identity match means the same storage): building it costs more host time than the GPU work.
        reads = (planned, step, self.pool.k, self.pool.v, self.meta.kmin, self.meta.kmax,
                 self.resident.table if self.resident is not None else None,
                 self.offloaded.selected if self.offloaded is not None else None)
        if self._launch is not None and all(a is b for a, b in zip(reads, self._launch[0])):
            return self._launch[1], self._launch[2]
        inputs = self._table_inputs(graph.query, step.num_tokens)
        if graph.scores is None or graph.scores.shape[1] < inputs.kmin.shape[2]:
            graph.scores = scores_buffer(inputs)
        scores = graph.scores

        def launch(keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor) -> None:
            append_token(keys, values, self.pool.k, self.pool.v, inputs.kmin, inputs.kmax, self.write_slots,
                         step.page, step.offset)
            decode_table(dataclasses.replace(inputs, query=query), scores, flat=planned.indices,
                         indptr=planned.indptr)
            self.backend.run_prepared(planned, query, self.pool.k, self.pool.v, out=graph.output)

        storage = (self.pool.k, self.pool.v, inputs.kmin, inputs.kmax, inputs.table, inputs.selected, scores)
        storage_key = (planned, *((t.data_ptr(), t.shape) if t is not None else None for t in storage))
        self._launch = (reads, launch, storage_key)
        return launch, storage_key

    def _decode_eager(self, rows_query: torch.Tensor, plan: AppendPlan, scale: float) -> torch.Tensor:
        """Build the ``[B * H, K]`` table (fused Triton kernels on CUDA, else torch) and run the backend."""
        if self._fused_table_fits():
            slots, page_lens = self._fused_table(rows_query, plan)
        else:
            slots, page_lens = self._decode_table(rows_query, plan)
        return self.backend.paged_decode(rows_query, self.pool.k, self.pool.v, slots, page_lens, scale,
                                         self._decode_layout(plan))

    def _table_inputs(self, rows_query: torch.Tensor, num_tokens: torch.Tensor) -> TableInputs:
        """What the Triton table kernels read: this layer's metadata, page tables and selections, with
        ``rows_query [B * H, G, D]`` and ``num_tokens [B]`` (real tokens after this step's token)."""
        from flexicache.backends.triton_select import TableInputs

        resident, offloaded = self.resident, self.offloaded
        return TableInputs(
            rows_query, self.meta.kmin, self.meta.kmax, resident.table if resident else None,
            offloaded.selected if offloaded else None, num_tokens, self.unstable_index, self.stable_index,
            offloaded.base if offloaded else 0, self.settings.pages_per_head, self.settings.page_size,
            self.settings.group_reduce,
        )

    def _fused_table_fits(self) -> bool:
        """Whether the Triton kernels can build this step's table (CUDA, Triton, rows short enough)."""
        if not self.fused_table:
            return False
        from flexicache.backends.triton_select import fits_fused_table

        return fits_fused_table(self.meta.kmin.shape[2])

    def _fused_table(self, rows_query: torch.Tensor, plan: AppendPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """The Triton kernels' ``(slots, page_lens)`` table, ``[B * H, K]`` (same contract as the torch one)."""
        from flexicache.backends.triton_select import decode_table, scores_buffer

        inputs = self._table_inputs(rows_query.contiguous(), plan.after)
        slots = torch.empty(rows_query.shape[0], self.settings.pages_per_head, dtype=torch.long, device=self.device)
        page_lens = torch.empty_like(slots)
        decode_table(inputs, scores_buffer(inputs), table_out=(slots, page_lens))
        return slots, page_lens

    def _decode_table(self, rows_query: torch.Tensor, plan: AppendPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Torch version of the decode table: ``(slots, page_lens)``, ``[B * H, K]``, every row's listed pages."""
        batch_size, k = self.batch_size, self.settings.pages_per_head
        last_page_len = (plan.after - 1) % self.settings.page_size + 1
        slots = torch.full((batch_size, self.num_kv_heads, k), -1, dtype=torch.long, device=self.device)
        page_lens = torch.zeros_like(slots)
        grouped = rows_query.view(batch_size, self.num_kv_heads, -1, rows_query.shape[-1])
        if self.resident is not None:
            unstable_query = grouped[:, self.unstable_index].flatten(0, 1)
            resident_slots, resident_lens = self._resident_selection(unstable_query, plan, last_page_len)
            width = resident_slots.shape[1]
            slots[:, self.unstable_index, :width] = resident_slots.view(batch_size, -1, width)
            page_lens[:, self.unstable_index, :width] = resident_lens.view(batch_size, -1, width)
        if self.offloaded is not None:
            stable_slots, stable_lens = self.offloaded.decode_pages(per_row(last_page_len, len(self.stable_heads)))
            slots[:, self.stable_index] = stable_slots.view(batch_size, -1, k)
            page_lens[:, self.stable_index] = stable_lens.view(batch_size, -1, k)
        return slots.flatten(0, 1), page_lens.flatten(0, 1)

    def _decode_layout(self, plan: AppendPlan) -> DecodeLayout:
        """The step's row layout, built by the first layer on this device and shared by the others."""
        return self._per_step(plan, "decode_layout", lambda: build_decode_layout(
            plan.after_host, self.num_kv_heads, self.settings.pages_per_head, self.settings.page_size))

    def _resident_selection(self, query: torch.Tensor, plan: AppendPlan, last_page_len: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-K pages (sink and tail forced) of every unstable row: ``(slots, page_lens)``, ``[B * hu, k]``."""
        page_size, num_heads = self.settings.page_size, len(self.unstable_heads)
        num_pages = per_row((plan.after + page_size - 1) // page_size, num_heads)
        width = plan.max_pages_after
        if width <= self.settings.pages_per_head:  # every page fits in the budget: no scoring needed
            pages = torch.arange(width, device=query.device).expand(query.shape[0], width)
            pages = pages.masked_fill(pages >= num_pages.unsqueeze(1), -1)
        else:
            kmin, kmax = self.meta.rows(self.unstable_index, width)
            scores = quest_page_scores(query, kmin, kmax, self.settings.group_reduce)
            pages, _ = select_pages(scores, num_pages, self.settings.pages_per_head, force_last=True)
        is_tail = pages == (num_pages - 1).unsqueeze(1)
        page_lens = torch.where(is_tail, per_row(last_page_len, num_heads).unsqueeze(1), page_size)
        page_lens = page_lens.masked_fill(pages < 0, 0)
        return self.resident.page_slots(pages), page_lens

    # ----------------------------------------------------------------------------------------------- read back

    def read_logical(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every committed token read back exactly, in logical positions: ``[B, H, L, D]`` (padding is zero)."""
        valid = self.sequence.logical_valid()[:, : self.committed_length]
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
        logical_shape = (self.batch_size, self.num_kv_heads, self.committed_length, self.head_dim)
        dense_keys = torch.zeros(logical_shape, dtype=self.dtype, device=self.device)
        dense_values = torch.zeros_like(dense_keys)
        batch, position = valid.nonzero(as_tuple=True)
        rank = (valid.long().cumsum(dim=1) - 1)[batch, position]
        dense_keys[batch, :, position] = keys[batch, :, rank]
        dense_values[batch, :, position] = values[batch, :, rank]
        return dense_keys, dense_values

    # --------------------------------------------------------------------------------------------------- stats

    def stats(self) -> dict[str, int]:
        """Byte counts and work counters of this layer (see :meth:`FlexiCache.stats`)."""
        if not self.is_initialized or self.plan is None:
            return {}
        page_size = self.settings.page_size
        element = torch.empty(0, dtype=self.dtype).element_size()
        page_bytes = 2 * page_size * self.head_dim * element  # keys + values of one page of one head
        pages_per_request = (self.sequence.num_tokens_host + page_size - 1) // page_size
        used_pages = int(pages_per_request.sum())
        stats = {  # in use (pages of the requests' real tokens) and reserved (capacity included)
            "device_kv_bytes": 0, "device_metadata_bytes": used_pages * self.num_kv_heads * page_bytes // page_size,
            "device_reserved_bytes": self.pool.nbytes_reserved + self.meta.nbytes,
            "host_kv_bytes": 0,
            "host_reserved_bytes": 0, "reranks_unstable": self.unstable_counters.reranks, "reranks_stable": 0,
            "promoted_pages": 0, "bytes_h2d": 0, "bytes_d2h": 0,
            "dense_kv_bytes": self.batch_size * self.num_kv_heads * self.logical_length * page_bytes // page_size,
        }
        if self.resident is not None:
            stats["device_kv_bytes"] += used_pages * len(self.unstable_heads) * page_bytes
        if self.offloaded is not None:
            counters = self.offloaded.counters
            stats["device_kv_bytes"] += self.offloaded.nbytes_reserved
            stats["host_kv_bytes"] += used_pages * len(self.stable_heads) * page_bytes
            stats["host_reserved_bytes"] += self.offloaded.host.nbytes_reserved
            stats["reranks_stable"] = counters.reranks
            stats["promoted_pages"] = int(counters.promoted_pages)
            stats["bytes_h2d"] = int(counters.bytes_h2d)
            stats["bytes_d2h"] = counters.bytes_d2h
        return stats


def _selection_fits_after_growth(capacity: int, next_pages: int) -> bool:
    """Whether the fused selection still holds a row of page metadata of ``capacity`` pages once it has grown for
    ``next_pages`` pages (:func:`~flexicache.paging.grown_size`)."""
    from flexicache.backends.triton_select import fits_fused_table

    return fits_fused_table(grown_size(capacity, next_pages))


def _full_tails(plan: AppendPlan) -> torch.Tensor:
    """``[B]`` bool (CPU): requests whose tail page filled up before this single-token step."""
    return (plan.before_host > 0) & (plan.before_host % plan.page_size == 0)


def _requests_with_full_tail(plan: AppendPlan, device: torch.device) -> torch.Tensor | None:
    """``[n]`` requests whose tail page filled up before this single-token step (``None`` if none)."""
    full = _full_tails(plan)
    return host_to_device(full.nonzero().view(-1), device) if bool(full.any()) else None


def check_supported_model(config: Any) -> None:
    """Raise ``ValueError`` for models FlexiCache cannot serve (it needs full causal self-attention layers)."""
    text_config = config.get_text_config(decoder=True)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("FlexiCache supports decoder-only models; encoder-decoder models need EncoderDecoderCache.")
    if getattr(text_config, "kv_lora_rank", None):
        raise ValueError("FlexiCache does not support multi-head latent attention (MLA) models; use DynamicCache.")
    layer_types, _ = get_layer_types_and_kwargs(text_config)
    unsupported = sorted({kind for kind in layer_types if kind != "full_attention"})
    if unsupported:
        raise ValueError(
            f"FlexiCache supports full-attention layers only, but this model has {unsupported} layers "
            "(sliding-window, chunked, linear or shared-KV attention). Use DynamicCache for this model, or, if the "
            "checkpoint does not really need its sliding window, set config.sliding_window = None first."
        )


class FlexiCache(DynamicCache):
    """Sparse top-K page KV cache with a host tier for temporally stable heads.

    Example::

        cache = FlexiCache.from_model(model, token_budget=1024)
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=256)
        cache.stats()

    Args:
        config: the model's config (shape, layer types).
        profile: a :class:`HeadProfile`, a path to one, or ``None`` for :meth:`HeadProfile.default`.
        token_budget, page_size, rerank_interval, group_reduce, backend, cuda_graphs, max_cache_len: see
            :class:`FlexiCacheConfig`.
    """

    def __init__(self, config: Any, profile: HeadProfile | str | os.PathLike | None = None, token_budget: int = 2048,
                 page_size: int = 16, rerank_interval: int = 16, group_reduce: str = "max",
                 backend: str = "auto", cuda_graphs: bool = True, max_cache_len: int | None = None) -> None:
        self.settings = FlexiCacheConfig(token_budget=token_budget, page_size=page_size,
                                         rerank_interval=rerank_interval, group_reduce=group_reduce, backend=backend,
                                         cuda_graphs=cuda_graphs, max_cache_len=max_cache_len)
        check_supported_model(config)
        if backend == "flashinfer":
            from flexicache.backends.flashinfer import flashinfer_available

            if not flashinfer_available():
                raise ImportError("backend='flashinfer' needs FlashInfer: pip install 'flexicache-kv[cuda]', "
                                  "or use backend='auto'.")
            require_flashinfer_support(None, model_shape(config)[2])  # the KV dtype is known at the first forward
        if profile is None:
            profile = HeadProfile.default(config)
        elif not isinstance(profile, HeadProfile):
            profile = HeadProfile.load(profile)
        profile.validate_for(config)
        self.profile = profile
        num_layers, num_kv_heads, _ = model_shape(config)
        self.sequence = SequenceState(page_size)
        self.backends: dict[torch.device, DecodeBackend] = {}
        self.step_inputs: dict[torch.device, StepInputs] = {}
        layers = [
            FlexiLayer(index, self.settings, profile.unstable_heads_of(index), num_kv_heads, self.sequence,
                       self.backends, self.step_inputs)
            for index in range(num_layers)
        ]
        Cache.__init__(self, layers=layers)
        self.step_graphs = StepGraphStore()  # whole-step CUDA graphs of this cache (flexicache.step_graph)
        self._next_reranks: tuple[AppendPlan, tuple[bool, ...]] | None = None  # prepare_next_step's, for its plan

    @classmethod
    def from_model(cls, model: torch.nn.Module, profile: HeadProfile | str | os.PathLike | None = None,
                   **settings: Any) -> FlexiCache:
        """Switch ``model`` to the flexicache attention and build a cache for it (under tensor parallelism: this
        rank's KV heads, with the profile sliced to them)."""
        config, profile = parallel.local_view(model, profile)
        cache = cls(config, profile=profile, **settings)  # validate first: bad input leaves the model as is
        if model.config._attn_implementation != attention.ATTENTION_NAME:
            model.set_attn_implementation(attention.ATTENTION_NAME)
        if cache.settings.cuda_graphs:
            enable_step_graphs(model)
        return cache

    # ----------------------------------------------------------------------------------------- cache protocol

    def reset(self) -> None:
        attention.clear_staged()
        for layer in self.layers:  # queued zero-copy kernels may still use the pinned host tier about to be freed
            if layer.is_initialized and layer.offloaded is not None and layer.offloaded.zero_copy:
                torch.cuda.synchronize(layer.device)
        self.sequence.reset()
        self.step_inputs.clear()
        self.step_graphs.clear()
        self._next_reranks = None
        super().reset()

    # ------------------------------------------------------------------------------- whole-step CUDA graphs

    def graphed_step_ready(self) -> bool:
        """Whether the next decode step's device work can run from a whole-step CUDA graph: every layer on one
        CUDA device ran a decode step on the CUDA graph path (FlashInfer + Triton) already."""
        layers = self.layers
        if not (self.settings.cuda_graphs and self.sequence.num_tokens_host is not None):
            return False
        page_size = self.settings.page_size
        next_pages = (int(self.sequence.num_tokens_host.max()) + page_size) // page_size  # after one more token
        if self.step_graphs.storage is not None and self.step_graphs.chunk == self.sequence.num_chunks:
            # The last step ran from a graph and nothing came since: only the capacity can have run out.
            capacities = {layer.meta.kmin.shape[2] for layer in layers}
            return all(_selection_fits_after_growth(capacity, next_pages) for capacity in capacities)
        return (all(layer.graphed_step_ready(next_pages) for layer in layers) and layers[0].device.type == "cuda"
                and all(layer.device == layers[0].device for layer in layers))

    def begin_graphed_step(self) -> tuple:
        """Host side of the next decode step (all layers); its device work must then run from a graph recorded
        under :meth:`recording`. Returns the key of that work (reranking layers and the storage it reads)."""
        return tuple(layer.begin_graphed_step() for layer in self.layers)

    def prepare_replay(self, storage: tuple) -> tuple[tuple[bool, ...], AppendPlan] | None:
        """Before replaying a recorded step whose graphs read ``storage`` (the storage part of the last
        :meth:`begin_graphed_step`): the device side of the next step's host work (its shared inputs; where it
        opens pages, the layers' reservations), leaving the rest to :meth:`finish_replay`, which may run while the
        GPU replays.

        Returns:
            ``(which layers rerank their stable heads, the step's plan)``, or ``None`` when a graph recorded for
            ``storage`` would read stale buffers. Either way the step has begun (its plan is taken, pages are
            reserved): after ``None`` the caller must take :meth:`begin_graphed_step` (which does not repeat the
            reservations) and record or replay.
        """
        layers = self.layers
        plan = layers[0].graphed_step_plan()
        if not layers[0].prepare_device_step(plan):
            return None
        if plan.num_new_pages:  # only a step that opens pages reserves, and only a reservation can reallocate
            for layer in layers:
                layer.reserve_graphed_step(plan)
            if tuple(layer.graph_storage_key(plan) for layer in layers) != storage:
                return None
        ahead = self._next_reranks
        reranks = ahead[1] if ahead is not None and ahead[0] is plan else self._reranks_due(plan)
        return reranks, plan

    def _reranks_due(self, plan: AppendPlan) -> tuple[bool, ...]:
        return tuple(layer.rerank_due(plan) for layer in self.layers)

    def finish_replay(self, plan: AppendPlan) -> None:
        """The host bookkeeping of a step prepared by :meth:`prepare_replay` that no device work reads."""
        for layer in self.layers:
            layer.finish_graphed_step(plan)

    def prepare_next_step(self) -> None:
        """Right after a graphed step is launched: the next decode step's plan and shared device inputs, made while
        the GPU works (their device writes queue behind the launched step). No state a caller sees changes: the
        next step takes them over if it is a decode step (:meth:`SequenceState.peek_decode_plan`), any other call
        recomputes its own."""
        first = self.layers[0]
        plan = self.sequence.peek_decode_plan(first.device)
        first.prepare_device_step(plan)
        self._next_reranks = (plan, self._reranks_due(plan))  # the rerank phase only moves with a step

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """While a forward of the step prepared by :meth:`begin_graphed_step` is recorded (or run once): layers
        only launch device work and change no host state."""
        for layer in self.layers:
            layer.recording = True
        try:
            yield
        finally:
            for layer in self.layers:
                layer.recording = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(
            "FlexiCache does not support beam search (num_beams > 1): use greedy decoding or sampling, "
            "or DynamicCache for beam search."
        )

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` logical positions (negative count, as transformers passes it)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}.")
        if tokens_to_remove == 0 or self.sequence.logical_length == 0:
            return
        keep = self.sequence.logical_length + tokens_to_remove
        self._rebuild(lambda tensor: tensor[:, :, :keep] if tensor.dim() == 4 else tensor[:, :keep])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rebuild(lambda tensor: tensor.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rebuild(lambda tensor: tensor[indices.to(tensor.device)])

    def _rebuild(self, transform: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Read every token back, transform keys/values ``[B, H, L, D]`` and validity ``[B, L]``, re-page.

        The stable heads rerank at the next decode step (their selection needs a query). The work counters are
        cumulative: they keep counting through the rebuild (whose own transfers are added).
        """
        if self.sequence.logical_length == 0:
            return
        valid = transform(self.sequence.logical_valid())
        contents = [(layer, *map(transform, layer.read_logical())) for layer in self.layers]
        counters = [(layer.unstable_counters, layer.offloaded.counters if layer.offloaded else None,
                     layer.decode_steps) for layer in self.layers]
        self.reset()
        for (layer, keys, values), (unstable_counters, stable_counters, decode_steps) in zip(contents, counters):
            with attention.on_device(layer.device):
                layer.lazy_initialization(keys, values)
                plan = self.sequence.plan_chunk(0, None if bool(valid.all()) else valid.to(layer.device),
                                                keys.shape[0], keys.shape[2], layer.device)
                layer.append(keys, values, plan)
            layer.logical_length = keys.shape[2]
            layer.unstable_counters, layer.decode_steps = unstable_counters, decode_steps
            if layer.offloaded is not None:
                layer.offloaded.steps_since_rerank = self.settings.rerank_interval
                for name in ("reranks", "promoted_pages", "bytes_h2d", "bytes_d2h"):
                    added = getattr(layer.offloaded.counters, name)
                    setattr(stable_counters, name, getattr(stable_counters, name) + added)
                layer.offloaded.counters = stable_counters

    # --------------------------------------------------------------------------------------------------- stats

    def stats(self) -> dict[str, Any]:
        """Memory and work counters, summed over layers.

        Keys: ``device_kv_bytes`` (pages in use on the device: unstable heads' pages + stable heads' K slots),
        ``device_metadata_bytes`` (page min/max of the pages in use), ``device_reserved_bytes`` (all device tensors,
        capacity included),
        ``host_kv_bytes`` (stable heads' pages in the host tier), ``host_reserved_bytes``, ``dense_kv_bytes``
        (what DynamicCache would hold), ``reranks_unstable``/``reranks_stable`` (rows reranked: one row is one
        request x one KV head), ``promoted_pages``, ``bytes_h2d``/``bytes_d2h``, ``decode_steps``, ``backend``,
        ``step_graph_captures``/``step_graph_replays`` (decode steps recorded / replayed as whole-step CUDA graphs).
        """
        totals: dict[str, Any] = {}
        for layer in self.layers:
            for name, value in layer.stats().items():
                totals[name] = totals.get(name, 0) + value
        first = self.layers[0]
        totals["decode_steps"] = first.decode_steps
        backends = sorted({layer.backend.name for layer in self.layers if layer.is_initialized})
        totals["backend"] = ",".join(backends) if backends else None  # e.g. "flashinfer,reference" on GPU + CPU
        totals["step_graph_captures"] = self.step_graphs.captures
        totals["step_graph_replays"] = self.step_graphs.replays
        totals["unstable_heads"] = len(self.profile.unstable_heads)
        totals["token_budget"] = self.settings.token_budget
        return totals
