"""The three ways a layer runs a decode step, behind one interface; chosen once, when the layer initialises.

Every path appends the step's token (``write_token``), scores the stable heads' full pages for their rerank
(``rerank_stable``) and attends over each row's selected pages (``run``):

- :class:`TorchDecode`: torch ops on any device; the backend's ``paged_decode`` attends;
- :class:`FusedDecode`: the same work in Triton kernels (CUDA, a power-of-two head dim), launched eagerly, for a
  backend that attends from a padded table (the torch reference on CUDA, e.g. for float32 KV);
- :class:`GraphedDecode`: the Triton kernels and a planned FlashInfer decode, captured as one CUDA graph per
  layer (:class:`~flexicache.decode_graph.DecodeGraph`) and replayed; it also holds the layer's part of a
  whole-step graph (:mod:`flexicache.step_graph`).

A row longer than the fused selection holds in registers falls back, step by step, to the path below (the fused
path to the torch table, the graphed path to the fused eager step). A path holds the layer's
:class:`~flexicache.storage.LayerStorage` and its backend, never the layer: what it launches refers to no object
that refers back to it, so a cache is freed by reference counting alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from flexicache.backends import DecodeBackend, PreparedBackend, triton_available
from flexicache.config import FlexiCacheConfig
from flexicache.decode_graph import DecodeGraph, StepInputs
from flexicache.paging import grown_size
from flexicache.selection import exact_page_scores, quest_page_scores, select_candidates, select_pages
from flexicache.sequence import AppendPlan, per_row
from flexicache.storage import LayerStorage

if TYPE_CHECKING:
    from flexicache.backends.triton_select import ExactScratch, TableInputs

Launch = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]  # (keys [B, H, D], values, query [R, G, D])


class DecodePath(Protocol):
    """What a layer asks of its decode path (see the module docstring); shapes as in :class:`TorchDecode`."""

    def write_token(self, keys: torch.Tensor, values: torch.Tensor, plan: AppendPlan) -> None: ...

    def rerank_stable(self, query: torch.Tensor, num_tokens: torch.Tensor, width: int, decode: bool = True
                      ) -> None: ...

    def run(self, keys: torch.Tensor, values: torch.Tensor, rows_query: torch.Tensor, plan: AppendPlan,
            scale: float) -> torch.Tensor: ...


def fused_kernels_available(device: torch.device, head_dim: int) -> bool:
    """Whether the Triton decode kernels serve KV of ``head_dim`` on ``device`` (they hold a head in one
    power-of-two block, ``tl.arange``; other head dims use torch ops)."""
    return device.type == "cuda" and triton_available() and head_dim & (head_dim - 1) == 0


def reserved_device_pages(settings: FlexiCacheConfig, fused: bool) -> int:
    """Device pages per row to reserve up front (``max_cache_len``'s), no more than the fused selection holds
    (``fused``; a longer row there takes the torch path, reserved or not)."""
    if not fused:
        return settings.reserved_pages
    from flexicache.backends.triton_select import MAX_SCORED_PAGES

    return min(settings.reserved_pages, MAX_SCORED_PAGES)


def selection_fits_after_growth(capacity: int, next_pages: int) -> bool:
    """Whether the fused selection still holds a row of page metadata of ``capacity`` pages once it has grown for
    ``next_pages`` pages (:func:`~flexicache.paging.grown_size`)."""
    from flexicache.backends.triton_select import fits_fused_table

    return fits_fused_table(grown_size(capacity, next_pages))


def choose_decode_path(storage: LayerStorage, backend: DecodeBackend, fused: bool,
                       step_inputs: dict[torch.device, StepInputs]) -> DecodePath:
    """The decode path of a layer with ``storage`` and ``backend`` (``fused``: :func:`fused_kernels_available` for
    its KV; ``step_inputs``: the cache's per-device step inputs, shared by the graphed paths of its layers)."""
    if not fused:
        return TorchDecode(storage, backend)
    if isinstance(backend, PreparedBackend):
        return GraphedDecode(storage, backend, step_inputs)
    return FusedDecode(storage, backend)


class TorchDecode:
    """A decode step in torch ops: token append, stable rerank scores and the ``[B * H, K]`` decode table; the
    backend's ``paged_decode`` attends. Works on any device and head dim."""

    def __init__(self, storage: LayerStorage, backend: DecodeBackend) -> None:
        self.storage = storage
        self.backend = backend
        self.settings = storage.settings

    def write_token(self, keys: torch.Tensor, values: torch.Tensor, plan: AppendPlan) -> None:
        """Write one token per request and head (``[B, H, D]``) into its tail page's slot and page min/max."""
        storage = self.storage
        storage.meta.append(storage.bound_token(keys), plan)
        offsets = plan.row_offsets(storage.num_kv_heads)
        slots = storage.write_slots.view(-1)
        storage.pool.k[slots, offsets] = keys.reshape(-1, storage.head_dim).to(storage.dtype)
        storage.pool.v[slots, offsets] = values.reshape(-1, storage.head_dim).to(storage.dtype)

    def stable_scores(self, query: torch.Tensor, num_tokens: torch.Tensor, width: int) -> torch.Tensor:
        """``[B * hs, width]`` Quest scores of the stable rows' pages for queries ``[B * hs, G, D]``."""
        kmin, kmax = self.storage.meta.rows(self.storage.stable_index, width)
        return quest_page_scores(query, kmin, kmax, self.settings.group_reduce, self.settings.spread_weight)

    def rerank_stable(self, query: torch.Tensor, num_tokens: torch.Tensor, width: int, decode: bool = True) -> None:
        """Rerank every stable row with its heads' queries from ``query [B, Hq, D]`` over its full pages (the tail
        page is not read). Device work only. ``num_tokens``: ``[B]`` real tokens per request (device); ``width``:
        pages scored per row, at least the longest row's full pages (columns beyond a row's are ignored);
        ``decode``: a decode step's rerank (``max_promotions`` applies), not a prompt chunk's."""
        storage = self.storage
        grouped = storage.bound_rows(storage.group_queries(query, storage.stable_index), storage.stable_index)
        full_pages = (num_tokens - 1).clamp(min=0) // self.settings.page_size
        scores = self.stable_scores(grouped, num_tokens, width)
        storage.offloaded.rerank(scores, per_row(full_pages, len(storage.stable_heads)),
                                 self.settings.max_promotions if decode else None)

    def run(self, keys: torch.Tensor, values: torch.Tensor, rows_query: torch.Tensor, plan: AppendPlan,
            scale: float) -> torch.Tensor:
        """Append the step's token (``keys``/``values`` ``[B, H, D]``) and attend: ``[B * H, G, D]`` for
        ``rows_query [B * H, G, D]`` over each row's listed pages."""
        self.write_token(keys, values, plan)
        storage = self.storage
        slots, page_lens = self.table(rows_query, plan, scale)
        layout = plan.decode_layout(storage.num_kv_heads, self.settings.pages_per_head, storage.row_pages_key)
        return self.backend.paged_decode(rows_query, storage.pool.k, storage.pool.v, slots, page_lens, scale, layout)

    def table(self, rows_query: torch.Tensor, plan: AppendPlan, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slots, page_lens)``, ``[B * H, K]``: every row's listed pages (the backend interface's table) for
        ``rows_query [B * H, G, D]`` and the attention's softmax ``scale`` (used by ``exact_rescore``); with
        ``head_budgets="prompt"`` as wide as the largest row's ``K``, a row's entries beyond its own empty."""
        storage = self.storage
        batch_size, num_kv_heads = storage.batch_size, storage.num_kv_heads
        last_page_len = (plan.after - 1) % self.settings.page_size + 1
        row_pages = storage.row_pages.view(batch_size, num_kv_heads)
        slots = torch.full((batch_size, num_kv_heads, storage.table_width), -1, dtype=torch.long,
                           device=storage.device)
        page_lens = torch.zeros_like(slots)
        grouped = rows_query.view(batch_size, num_kv_heads, -1, rows_query.shape[-1])
        if storage.resident is not None:
            unstable_query = grouped[:, storage.unstable_index].flatten(0, 1)
            unstable_pages = row_pages[:, storage.unstable_index].flatten()
            resident_slots, resident_lens = self._resident_selection(unstable_query, plan, last_page_len, scale,
                                                                     unstable_pages)
            width = resident_slots.shape[1]
            slots[:, storage.unstable_index, :width] = resident_slots.view(batch_size, -1, width)
            page_lens[:, storage.unstable_index, :width] = resident_lens.view(batch_size, -1, width)
        if storage.offloaded is not None:
            scores = None
            if storage.offloaded.standby_pages:  # this step's scores of the working sets' pages
                stable_query = grouped[:, storage.stable_index].flatten(0, 1)
                if self.settings.exact_rescore:  # the working set's keys are on the device: rank by them
                    slots_held, lens_held = storage.offloaded.held_pages()
                    scores = exact_page_scores(stable_query, storage.pool.k[slots_held], lens_held, scale)
                else:
                    kmin, kmax = storage.meta.listed_rows(storage.stable_index, storage.offloaded.selected)
                    scores = quest_page_scores(storage.bound_rows(stable_query, storage.stable_index), kmin, kmax,
                                               self.settings.group_reduce, self.settings.spread_weight)
            stable_pages = None if storage.row_pages_key is None else row_pages[:, storage.stable_index].flatten()
            stable_slots, stable_lens = storage.offloaded.decode_pages(
                per_row(last_page_len, len(storage.stable_heads)), scores, stable_pages)
            width = min(stable_slots.shape[1], slots.shape[2])
            slots[:, storage.stable_index, :width] = stable_slots[:, :width].view(batch_size, -1, width)
            page_lens[:, storage.stable_index, :width] = stable_lens[:, :width].view(batch_size, -1, width)
        return slots.flatten(0, 1), page_lens.flatten(0, 1)

    def _resident_selection(self, query: torch.Tensor, plan: AppendPlan, last_page_len: torch.Tensor, scale: float,
                            row_pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-``k`` pages (sink and tail forced) of every unstable row, ``k`` its ``row_pages [B * hu]``: ``(slots,
        page_lens)``, ``[B * hu, max k]``; with ``exact_rescore`` the ``k`` of most attention mass among the top
        ``exact_candidates * K`` by box score."""
        storage, settings = self.storage, self.settings
        page_size, num_heads, k = settings.page_size, len(storage.unstable_heads), settings.pages_per_head
        num_pages = per_row((plan.after + page_size - 1) // page_size, num_heads)
        width = plan.max_pages_after
        row_k = k if storage.row_pages_key is None else row_pages
        fits = width <= storage.fewest_pages
        if fits:  # every page fits in every row's budget: no scoring needed
            pages = torch.arange(width, device=query.device).expand(query.shape[0], width)
            pages = pages.masked_fill(pages >= num_pages.unsqueeze(1), -1)
        else:
            kmin, kmax = storage.meta.rows(storage.unstable_index, width)
            scores = quest_page_scores(storage.bound_rows(query, storage.unstable_index), kmin, kmax,
                                       settings.group_reduce, settings.spread_weight)
            listed = settings.candidate_pages if settings.exact_rescore else row_k
            pages, _ = select_pages(scores, num_pages, listed, force_last=True, most=storage.table_width)
        slots, lens = storage.resident.page_slots(pages), self._page_lens(pages, num_pages, last_page_len)
        if fits or not settings.exact_rescore:
            return slots, lens
        exact = exact_page_scores(query, storage.pool.k[slots], lens, scale)
        columns = select_candidates(pages, exact, row_k, most=storage.table_width)
        listed = columns >= 0
        columns = columns.clamp(min=0)
        return slots.gather(1, columns).masked_fill(~listed, -1), lens.gather(1, columns).masked_fill(~listed, 0)

    def _page_lens(self, pages: torch.Tensor, num_pages: torch.Tensor, last_page_len: torch.Tensor) -> torch.Tensor:
        """``[B * hu, k]`` tokens in each of the unstable rows' ``pages`` (``-1``: none; the tail partly filled)."""
        is_tail = pages == (num_pages - 1).unsqueeze(1)
        lens = torch.where(is_tail, per_row(last_page_len, len(self.storage.unstable_heads)).unsqueeze(1),
                           self.settings.page_size)
        return lens.masked_fill(pages < 0, 0)


class FusedDecode(TorchDecode):
    """:class:`TorchDecode` with the token append, the scoring and the selection in Triton kernels (launched one by
    one); rows longer than the fused selection holds build their table in torch."""

    def write_token(self, keys: torch.Tensor, values: torch.Tensor, plan: AppendPlan) -> None:
        from flexicache.backends.triton_select import append_token

        storage = self.storage
        append_token(keys, values, storage.pool.k, storage.pool.v, storage.meta.kmin, storage.meta.kmax,
                     storage.write_slots, plan.page, plan.offset,
                     bound_keys=None if storage.basis is None else storage.basis.token(keys))

    def stable_scores(self, query: torch.Tensor, num_tokens: torch.Tensor, width: int) -> torch.Tensor:
        """One kernel reading the min/max in place (the torch path gathers and upcasts them)."""
        from flexicache.backends.triton_select import stable_page_scores

        storage, settings = self.storage, self.settings
        return stable_page_scores(query, storage.meta.kmin, storage.meta.kmax, num_tokens, storage.stable_index,
                                  width, settings.page_size, settings.group_reduce, settings.spread_weight)

    def fits(self) -> bool:
        """Whether the Triton kernels can build this step's table (rows short enough for their registers)."""
        from flexicache.backends.triton_select import fits_fused_table

        return fits_fused_table(self.storage.meta.kmin.shape[2])

    def table(self, rows_query: torch.Tensor, plan: AppendPlan, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The Triton kernels' ``(slots, page_lens)`` table, ``[B * H, K]`` (as wide as the largest row's own ``K``
        with ``head_budgets="prompt"``; same contract as the torch one)."""
        if not self.fits():
            return super().table(rows_query, plan, scale)
        from flexicache.backends.triton_exact import ExactInputs, exact_decode_table
        from flexicache.backends.triton_select import decode_table, exact_scratch, scores_buffer, working_scores_buffer

        inputs = self.table_inputs(self.storage.bound_rows(rows_query).contiguous(), plan.after)
        slots = torch.empty(rows_query.shape[0], self.storage.table_width, dtype=torch.long,
                            device=self.storage.device)
        page_lens = torch.empty_like(slots)
        if self.settings.exact_rescore:
            exact = ExactInputs(rows_query.contiguous(), self.storage.pool.k, scale,
                                exact_scratch(inputs, rows_query.shape[1]))
            exact_decode_table(inputs, exact, scores_buffer(inputs), working_scores_buffer(inputs),
                               table_out=(slots, page_lens))
        else:
            decode_table(inputs, scores_buffer(inputs), table_out=(slots, page_lens))
        return slots, page_lens

    def table_inputs(self, rows_query: torch.Tensor, num_tokens: torch.Tensor) -> TableInputs:
        """What the Triton table kernels read: the layer's metadata, page tables and selections, with
        ``rows_query [B * H, G, D]`` and ``num_tokens [B]`` (real tokens after this step's token)."""
        from flexicache.backends.triton_select import TableInputs

        storage, settings = self.storage, self.settings
        resident, offloaded = storage.resident, storage.offloaded
        return TableInputs(
            rows_query, storage.meta.kmin, storage.meta.kmax, resident.table if resident else None,
            offloaded.selected if offloaded else None, offloaded.selected_scores if offloaded else None, num_tokens,
            storage.unstable_index, storage.stable_index,
            offloaded.base if offloaded else 0, settings.pages_per_head, settings.page_size, settings.group_reduce,
            settings.spread_weight, storage.row_pages, storage.table_width, storage.fewest_pages,
            settings.max_row_pages, settings.candidate_pages,
        )


class GraphedDecode(FusedDecode):
    """:class:`FusedDecode` with a planned FlashInfer-style backend: the token append, table and sparse decode of a
    step are one captured CUDA graph, replayed while nothing it reads moved.

    Holds the graph (built at the first step that fits, when the group size is known), the softmax scale, the last
    step's launch and, for a whole-step graph, the work its recording replays.
    """

    backend: PreparedBackend

    def __init__(self, storage: LayerStorage, backend: PreparedBackend,
                 step_inputs: dict[torch.device, StepInputs]) -> None:
        super().__init__(storage, backend)
        self.step_inputs = step_inputs  # the cache's: one set of per-step inputs per device, shared by its layers
        self.graph: DecodeGraph | None = None
        self.scale: float | None = None  # the attention's softmax scale, seen at the first decode step
        self._launch: tuple | None = None  # (what it reads, launch, storage key) of the last _step_launch
        self.recorded_rerank = False  # whether the step a whole-step graph records reranks the stable heads
        self.recorded_launch: Launch | None = None  # and the launch it records
        self.exact_buffers: ExactScratch | None = None  # with exact_rescore: the scratch the last launch writes

    def run(self, keys: torch.Tensor, values: torch.Tensor, rows_query: torch.Tensor, plan: AppendPlan,
            scale: float) -> torch.Tensor:
        self.scale = scale
        if not self.fits():
            return super().run(keys, values, rows_query, plan, scale)
        storage = self.storage
        if self.graph is None:
            self.graph = DecodeGraph(storage.batch_size, storage.num_kv_heads, rows_query.shape[1], storage.head_dim,
                                     storage.dtype, storage.device, capture=self.settings.cuda_graphs,
                                     bound_dtype=None if storage.basis is None else storage.basis.matrix.dtype)
        launch, storage_key = self._step_launch(plan)
        graph = self.graph
        graph.load(keys, values, rows_query)
        return graph.run(lambda: launch(graph.keys, graph.values, graph.query), storage_key)

    def _device_step(self, plan: AppendPlan) -> tuple[object, StepInputs]:
        """The step's inputs on the device, shared by the layers of a device (the first layer's call makes them):
        the backend's plan and the :class:`StepInputs`."""
        storage, settings = self.storage, self.settings
        layout = plan.decode_layout(storage.num_kv_heads, settings.pages_per_head, storage.row_pages_key)
        planned = self.backend.prepare(layout, self.graph.query.shape[1], storage.head_dim, settings.page_size,
                                       storage.table_width, storage.dtype, self.scale,
                                       owner=None if storage.row_pages_key is None else storage)
        if storage.device not in self.step_inputs:
            self.step_inputs[storage.device] = StepInputs(storage.batch_size, storage.device)
        return planned, self.step_inputs[storage.device].load(plan)

    def _step_launch(self, plan: AppendPlan) -> tuple[Launch, tuple]:
        """This step's device work (token append, scoring, selection, sparse decode into the graph's output) and
        the key of the storage it reads; plans the step (once per step)."""
        from flexicache.backends.triton_exact import ExactInputs, exact_decode_table
        from flexicache.backends.triton_select import (
            append_token,
            decode_table,
            exact_scratch,
            scores_buffer,
            working_scores_buffer,
        )

        storage, graph = self.storage, self.graph
        planned, step = self._device_step(plan)
        # Reuse the last step's launch while nothing it reads was replaced (the tuple keeps those objects alive,
        # so an identity match means the same storage): building it costs more host time than the GPU work.
        reads = (planned, step, storage.pool.k, storage.pool.v, storage.meta.kmin, storage.meta.kmax,
                 storage.resident.table if storage.resident is not None else None,
                 storage.offloaded.selected if storage.offloaded is not None else None)
        if self._launch is not None and all(a is b for a, b in zip(reads, self._launch[0])):
            return self._launch[1], self._launch[2]
        inputs = self.table_inputs(graph.query, step.num_tokens)
        if graph.scores is None or graph.scores.shape[1] < inputs.kmin.shape[2]:
            graph.scores = scores_buffer(inputs)
        if graph.working_scores is None:
            graph.working_scores = working_scores_buffer(inputs)
        scores, working_scores = graph.scores, graph.working_scores
        exact = None
        if self.settings.exact_rescore:  # its scratch is kept while it fits: a captured graph writes it
            group = graph.query.shape[1]
            if self.exact_buffers is None or not self.exact_buffers.fits(inputs, group):
                self.exact_buffers = exact_scratch(inputs, group)
            exact = ExactInputs(graph.query, storage.pool.k, self.scale, self.exact_buffers)
        output, run_prepared = graph.output, self.backend.run_prepared
        basis = storage.basis  # the page boxes' axes (principal_bounds): set by the prefill, kept
        bound_keys, bound_query = graph.bound_keys, graph.bound_query

        def launch(keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor) -> None:  # refers to no path
            if basis is not None:
                basis.token(keys, out=bound_keys)
                basis.rows(query, out=bound_query)
            append_token(keys, values, storage.pool.k, storage.pool.v, inputs.kmin, inputs.kmax, storage.write_slots,
                         step.page, step.offset, bound_keys=bound_keys)
            table_inputs = dataclasses.replace(inputs, query=query if basis is None else bound_query)
            if exact is None:
                decode_table(table_inputs, scores, working_scores, flat=planned.indices, indptr=planned.indptr)
            else:
                exact_decode_table(table_inputs, dataclasses.replace(exact, query=query), scores, working_scores,
                                   flat=planned.indices, indptr=planned.indptr)
            run_prepared(planned, query, storage.pool.k, storage.pool.v, out=output)

        read = (storage.pool.k, storage.pool.v, inputs.kmin, inputs.kmax, inputs.table, inputs.selected, scores,
                working_scores, *(exact.scratch.tensors() if exact is not None else ()))
        storage_key = (planned, *((t.data_ptr(), t.shape) if t is not None else None for t in read))
        self._launch = (reads, launch, storage_key)
        return launch, storage_key

    # --------------------------------------------------------------------- the layer's part of a whole step

    def step_ready(self, next_pages: int) -> bool:
        """Whether this layer's next decode step can be recorded into a whole-step CUDA graph: it ran a step on the
        graph path before (static buffers, scale and compiled kernels exist), transfers are zero-copy (torch
        transfers wait for the device), no crop left pages whose pool slots the next tokens reuse (the recorded
        page opening takes new slots; the eager step reuses them) and the fused selection still fits once the next
        token's page is reserved (``next_pages``: the longest request's pages after one more token)."""
        offloaded, resident = self.storage.offloaded, self.storage.resident
        if not (self.graph is not None and self.scale is not None and self.settings.cuda_graphs
                and (offloaded is None or offloaded.zero_copy) and (resident is None or resident.spare is None)):
            return False
        return selection_fits_after_growth(self.storage.meta.kmin.shape[2], next_pages)

    def prepare_device_step(self, plan: AppendPlan) -> bool:
        """:meth:`_device_step` for ``plan``; returns whether its buffers are those this layer's last launch reads
        (``False``: a graph recorded before would read stale ones)."""
        planned, step = self._device_step(plan)
        return self._launch is not None and self._launch[0][0] is planned and self._launch[0][1] is step

    def recording_launch(self, plan: AppendPlan) -> tuple[Launch, tuple]:
        """:meth:`_step_launch` of ``plan`` with the key of everything a recorded step reads (the rerank's too)."""
        launch, storage_key = self._step_launch(plan)
        offloaded = self.storage.offloaded
        if offloaded is not None:  # what the rerank reads and writes besides the launch's storage
            storage_key += tuple((t.data_ptr(), t.shape) for t in (
                offloaded.host.k, offloaded.host.v, offloaded.selected, offloaded.selected_scores))
        return launch, storage_key

    def prepare_recording(self, plan: AppendPlan, rerank: bool) -> tuple[bool, tuple]:
        """Set up :meth:`record_step` for the step ``plan`` (``rerank``: whether its stable heads rerank); returns
        the key of the recorded work: ``(rerank, storage key)``."""
        self.recorded_rerank = rerank
        self.recorded_launch, storage_key = self.recording_launch(plan)
        return rerank, storage_key

    def record_step(self, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor, rows_query: torch.Tensor
                    ) -> torch.Tensor:
        """The device work of the step :meth:`prepare_recording` set up, host-state free: every per-step value
        comes from static buffers, so a graph of it replays correctly at later steps. Tail retirement and page
        opening run at every step and act where this step's token starts a page.

        Args:
            keys, values: ``[B, H, D]``; query: ``[B, Hq, D]``; rows_query: the same as ``[B * H, G, D]``.
        """
        from flexicache.backends.triton_transfer import open_pages

        storage, step = self.storage, self.step_inputs[self.storage.device]
        if storage.offloaded is not None:
            storage.offloaded.retire_full_tails_on_device(step.before)
        if storage.resident is not None:
            open_pages(storage.resident.table, storage.write_slots, storage.unstable_index, step.page, step.offset,
                       storage.open_start)
        if self.recorded_rerank:  # scores the metadata's whole capacity: a width that does not change per step
            self.rerank_stable(query, step.num_tokens, storage.meta.kmin.shape[2])
        # The recorded step's own tensors are static inside its graph: no copy into the graph's buffers.
        self.recorded_launch(keys, values, rows_query.contiguous())
        return self.graph.output
