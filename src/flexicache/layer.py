"""``FlexiLayer``: one decoder layer's KV in a FlexiCache, with transformers' cache-layer protocol.

The layer holds its :class:`~flexicache.storage.LayerStorage` (device pages, page metadata, host tier) and its decode
path (:mod:`flexicache.decode_paths`), both made at the first ``update`` (without a profile: at the first commit,
once the head split is known), and orchestrates them: a prefill chunk is committed into the pages before its dense
attention, and a decode token is appended and attended sparsely. Lengths and
step counts live in the cache's shared :class:`~flexicache.sequence.SequenceState`; the layer keeps how many chunks
it stored and its own work counters.

The storage is a buffer, not part of an autograd graph: keys, values and queries that require grad (a forward in
plain mode) are stored and used detached, so the sparse decode's output carries no gradient, like FlashInfer's.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from flexicache import decode_paths, handoff, head_budgets
from flexicache.attention import on_device
from flexicache.backends import DecodeBackend, layer_backend
from flexicache.config import PROMPT_TAIL_QUERIES, FlexiCacheConfig
from flexicache.decode_graph import StepInputs
from flexicache.decode_paths import DecodePath, GraphedDecode
from flexicache.head_split import OnlineHeadSplit
from flexicache.profiling.pages import tail_page_mass
from flexicache.sequence import AppendPlan, SequenceState
from flexicache.storage import LayerStorage

CLOSED_MESSAGE = "This FlexiCache was closed (cache.close() or the end of its `with` block); build a new FlexiCache."


class FlexiLayer(CacheLayerMixin):
    """One decoder layer's KV: resident (unstable) heads, offloaded (stable) heads, and their page metadata.

    Args:
        sequence: the cache's per-request bookkeeping, shared by its layers.
        backends: the cache's decode backend per device, shared by its layers (one plan per step, but for layers
            with their own split of the pages, ``head_budgets="prompt"``, which keep their own).
        step_inputs: the cache's per-step device inputs of the CUDA-graph path, shared by its layers.
    """

    is_sliding = False
    is_croppable = True

    def __init__(self, layer_idx: int, settings: FlexiCacheConfig, unstable_heads: list[int], num_kv_heads: int,
                 sequence: SequenceState, backends: dict[torch.device, DecodeBackend],
                 step_inputs: dict[torch.device, StepInputs], head_split: OnlineHeadSplit | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.settings = settings
        self.num_kv_heads = num_kv_heads
        self.profile_unstable = list(unstable_heads)  # the profile's (with head_split: where the prompt cannot tell)
        self.head_split = head_split  # the cache's online split (flexicache.head_split), or None: the profile's
        self.sequence = sequence
        self.backends = backends
        self.step_inputs = step_inputs
        self.recording = False  # True while a whole-step graph records a forward (flexicache.step_graph)
        self.closed = False
        self._clear()

    def _clear(self) -> None:
        """Drop the storage and decode path (their buffers are freed as soon as nothing else refers to them)."""
        self.is_initialized = False
        # with an online split, every head counts as stable until the first prompt chunk decides (the host-memory
        # check before that chunk then asks for the most a host tier can take)
        self._use_heads(self.profile_unstable if self.head_split is None else [])
        self.num_chunks = 0  # chunks (prefill chunks and decode steps) stored in this layer's pages
        self.storage: LayerStorage | None = None
        self.backend: DecodeBackend | None = None
        self.path: DecodePath | None = None
        self.graphed: GraphedDecode | None = None  # the path, when it is the CUDA-graph one
        self.unstable_reranks = 0  # rows of unstable heads reranked (one per row and decode step)
        self.prompt_gains: torch.Tensor | None = None  # head_budgets="prompt": the first chunk's, until it is stored

    @property
    def awaits_head_split(self) -> bool:
        """Whether this layer's heads wait for the cache's online split (its first prompt chunk is still to come)."""
        return self.head_split is not None and not self.is_initialized

    def _use_heads(self, unstable_heads: list[int]) -> None:
        self.unstable_heads = sorted(unstable_heads)
        self.stable_heads = [head for head in range(self.num_kv_heads) if head not in self.unstable_heads]

    # ------------------------------------------------------------------------------------ transformers protocol

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch_size, num_heads, _, head_dim = key_states.shape
        self._check_num_heads(num_heads)
        device, dtype = key_states.device, key_states.dtype
        fused = decode_paths.fused_kernels_available(device, head_dim)
        storage = LayerStorage(self.settings, self.unstable_heads, self.num_kv_heads, batch_size, head_dim, dtype,
                               device, decode_paths.reserved_device_pages(self.settings, fused))
        self.backend = layer_backend(self.backends, self.settings.backend, device, dtype, head_dim)
        self.use_storage(storage)

    def _check_num_heads(self, num_heads: int) -> None:
        if num_heads != self.num_kv_heads:
            raise ValueError(
                f"Layer {self.layer_idx} received {num_heads} KV heads but the HeadProfile/config has "
                f"{self.num_kv_heads}; build the cache from this model's config (under tensor parallelism with "
                "FlexiCache.from_model(model), which keeps this rank's KV heads)."
            )

    def use_storage(self, storage: LayerStorage) -> None:
        """Hold ``storage`` (made at the first update, or for a new selection of requests) with the decode path
        chosen for it."""
        fused = decode_paths.fused_kernels_available(storage.device, storage.head_dim)
        self.storage = storage
        self.path = decode_paths.choose_decode_path(storage, self.backend, fused, self.step_inputs)
        self.graphed = self.path if isinstance(self.path, GraphedDecode) else None
        self.is_initialized = True

    @property
    def device(self) -> torch.device:
        return self.storage.device

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage the new tokens for the flexicache attention; return the keys/values dense attention would need.

        Args:
            key_states, value_states: ``[B, H, T, D]`` (RoPE applied).

        Returns:
            The new tokens for a prefill or a decode step; past (read back from the pages) + new for several
            tokens on a non-empty cache, ``[B, H, L + T, D]``.
        """
        if self.closed:
            raise RuntimeError(CLOSED_MESSAGE)
        if not key_states.shape[0]:
            raise ValueError(f"Layer {self.layer_idx} received keys of shape {tuple(key_states.shape)}: a batch of no "
                             "requests; pass at least one request.")
        if not self.is_initialized and (self.head_split is None or key_states.shape[2] == 1):
            if self.head_split is not None:  # no prompt to estimate the split from
                self._use_heads(self.profile_unstable)
            self.lazy_initialization(key_states, value_states)  # else at commit, once the prompt chose the heads
        start = self.get_seq_length()
        keys, values = _detached(key_states), _detached(value_states)
        if self.recording:  # a whole-step graph capture: begin_graphed_step stored this step already
            handoff.stage(self, self.layer_idx, keys, values, start - 1)
            return key_states, value_states
        if start == 0 or key_states.shape[2] == 1:
            handoff.stage(self, self.layer_idx, keys, values, start)
            return key_states, value_states
        past_keys, past_values = self.read_logical()
        full_keys = torch.cat([past_keys, key_states], dim=2)
        full_values = torch.cat([past_values, value_states], dim=2)
        handoff.stage(self, self.layer_idx, keys, values, start)  # only once nothing here can fail
        return full_keys, full_values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        """Logical positions (padding included) this layer stored."""
        return self.sequence.logical_length_after(self.num_chunks)

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._clear()

    def close(self) -> None:
        """Free the storage now and refuse any later use."""
        self._clear()
        self.closed = True

    # ----------------------------------------------------------------------------------------- commit & decode

    def commit(self, chunk: handoff.StagedChunk, query: torch.Tensor, real_tokens: torch.Tensor | None) -> None:
        """Write a staged chunk of several tokens (or a first token) into pages (padding skipped); rerank the
        stable heads after it. Without a profile the first prompt chunk is parked until every layer has scored its
        heads (:mod:`flexicache.head_split`); the last layer to park stores them all.

        Args:
            query: ``[B, Hq, T, D]`` queries of the chunk (the last one seeds the stable heads' selection).
            real_tokens: ``[B, T]`` bool or ``None`` (all real).
        """
        split_pending, query = self.awaits_head_split, _detached(query)
        page_size = self.settings.page_size
        # the prompt tail's attention per page: what the page split and the staleness score read
        reads_tail = (self.settings.head_budgets == "prompt"
                      or (split_pending and self.settings.split_score == "staleness"))
        tail_mass = None
        if reads_tail and self.num_chunks == 0 and chunk.keys.shape[2] > 1:
            tail_mass = tail_page_mass(query, chunk.keys, real_tokens, page_size, PROMPT_TAIL_QUERIES)
            if self.settings.head_budgets == "prompt":
                self.prompt_gains = head_budgets.prompt_page_gains(tail_mass, -(-chunk.keys.shape[2] // page_size))
        if not split_pending:
            self._store(chunk, query, real_tokens)
            return
        self._check_num_heads(chunk.keys.shape[1])  # an online split: this first prompt chunk waits for the others
        split = self.head_split
        for unstable in split.park(chunk, query, real_tokens, self.settings, self.profile_unstable, tail_mass):
            parked = split.parked[0]  # in layer order, each released once stored (a failure leaves it parked)
            layer = parked.layer
            if layer is not None:
                with on_device(parked.chunk.keys.device):
                    layer._store_first(parked.chunk, parked.last_query, parked.real_tokens, unstable)
            split.release_first()

    def _store_first(self, chunk: handoff.StagedChunk, last_query: torch.Tensor, real_tokens: torch.Tensor | None,
                     unstable_heads: list[int]) -> None:
        """Make the storage for the online split's ``unstable_heads`` and store the parked first chunk in it."""
        self._use_heads(unstable_heads)
        self.lazy_initialization(chunk.keys, chunk.values)
        self._store(chunk, last_query, real_tokens)

    def _store(self, chunk: handoff.StagedChunk, query: torch.Tensor, real_tokens: torch.Tensor | None) -> None:
        """:meth:`commit` into this layer's storage; ``query [B, Hq, T', D]`` (only the last position is read)."""
        keys, values = chunk.keys, chunk.values
        if self.prompt_gains is not None:  # the first chunk: split each request's pages across its heads
            self.storage.use_row_pages(head_budgets.prompt_row_pages(self.prompt_gains, self.settings,
                                                                     self.unstable_heads))
            self.prompt_gains = None
        plan = self.sequence.plan_chunk(self.num_chunks, real_tokens, keys.shape[0], keys.shape[2], self.device)
        offloaded = self.storage.offloaded
        try:
            self.append(keys, values, plan)
            width = plan.full_page_width
            if offloaded is not None and width:
                self.path.rerank_stable(_detached(query[:, :, -1]), plan.after, width, decode=False)
                offloaded.counters.reranks += offloaded.num_rows
        finally:  # the tail refresh and the rerank read the staged chunk; nothing after them does
            if offloaded is not None:
                offloaded.release_staged()
        if offloaded is not None:
            # Stagger: layer l reranks at decode steps where (step + l) % interval == 0, so no step pays them all.
            offloaded.steps_since_rerank = self.layer_idx % self.settings.rerank_interval
            offloaded.steps_since_prompt = 0

    def append(self, keys: torch.Tensor, values: torch.Tensor, plan: AppendPlan) -> None:
        """Append a chunk ``[B, H, T, D]`` to both head classes following ``plan``."""
        if plan.is_single_token:
            self.storage.prepare_token_slots(plan)
            self.path.write_token(keys[:, :, 0], values[:, :, 0], plan)
        else:
            self.storage.append_chunk(keys, values, plan)
        self.num_chunks += 1

    def decode(self, chunk: handoff.StagedChunk, query: torch.Tensor, scale: float) -> torch.Tensor:
        """One decode token: append it, rerank the rows that are due, attend over each row's selected pages.

        Unstable and stable rows list their pages in one ``[B * H, K]`` table over the layer's pool (as wide as the
        largest row's own ``K`` with ``head_budgets="prompt"``), so the backend runs once per layer with the step's
        layout.

        Args:
            query: ``[B, Hq, 1, D]``; the chunk's keys/values: ``[B, H, 1, D]``.

        Returns:
            ``[B, 1, Hq, D]``.
        """
        batch_size, num_query_heads, _, head_dim = query.shape
        query = _detached(query)
        rows_query = query.reshape(batch_size * self.num_kv_heads, num_query_heads // self.num_kv_heads, head_dim)
        keys, values = chunk.keys[:, :, 0], chunk.values[:, :, 0]
        if self.recording:
            output = self.graphed.record_step(keys, values, query[:, :, 0], rows_query)
            return output.view(batch_size, num_query_heads, head_dim).unsqueeze(1)
        plan = self.sequence.plan_chunk(self.num_chunks, None, batch_size, 1, self.device, decode=True)
        self.storage.prepare_token_slots(plan)
        rerank_width = self._count_decode_step(plan)
        if rerank_width:  # reads full pages only, so it may run before the token is written
            self.path.rerank_stable(query[:, :, 0], plan.after, rerank_width)
        output = self.path.run(keys, values, rows_query, plan, scale)
        self.num_chunks += 1
        return output.view(batch_size, num_query_heads, head_dim).unsqueeze(1)

    def _count_decode_step(self, plan: AppendPlan) -> int:
        """Host bookkeeping of a decode step: rerank counters, the stable heads' rerank phase.

        Returns the score width of this step's stable rerank (``0``: none due, or no full page yet).
        """
        storage = self.storage
        if storage.resident is not None:
            self.unstable_reranks += storage.batch_size * len(self.unstable_heads)
        offloaded = storage.offloaded
        if offloaded is None:
            return 0
        due = self.rerank_due(plan)  # read before the phase moves
        offloaded.steps_since_rerank += 1
        offloaded.steps_since_prompt += 1
        if offloaded.steps_since_rerank >= self.settings.rerank_interval:
            offloaded.steps_since_rerank = 0
        if not due:
            return 0
        offloaded.counters.reranks += offloaded.num_rows
        return plan.full_page_width

    def rerank_due(self, plan: AppendPlan) -> bool:
        """Whether the stable heads rerank at the decode step ``plan`` (no state change)."""
        offloaded = self.storage.offloaded
        return (offloaded is not None and plan.full_page_width > 0
                and (offloaded.steps_since_rerank + 1 >= self.settings.rerank_interval
                     or offloaded.steps_since_prompt + 1 <= self.settings.rerank_warmup))

    # ------------------------------------------------------- whole-step CUDA graphs (flexicache.step_graph)

    def graphed_step_ready(self, next_pages: int) -> bool:
        """Whether this layer's next decode step can be recorded into a whole-step CUDA graph (``next_pages``: the
        longest request's pages after one more token)."""
        return self.is_initialized and self.graphed is not None and self.graphed.step_ready(next_pages)

    def graphed_step_plan(self) -> AppendPlan:
        """The plan of this layer's next decode step (computed once per step, shared by the layers): the first
        layer's call takes the step, advancing the cache's :class:`~flexicache.sequence.SequenceState` (its chunk and
        decode-step counts)."""
        return self.sequence.plan_chunk(self.num_chunks, None, self.storage.batch_size, 1, self.device, decode=True)

    def begin_graphed_step(self) -> tuple[bool, tuple]:
        """Host side of a decode step whose device work a whole-step graph replays: what ``update`` and
        :meth:`decode` do on the host (pool slots and host-tier room for the pages the step opens and retires,
        counters, the backend's plan, the step's static inputs); prepares the recorded work.

        Returns:
            The key of the recorded work: whether the stable heads rerank, and the storage it reads.
        """
        plan = self.graphed_step_plan()
        if self.storage.offloaded is not None:  # before the recorded work (a capture cannot wait on it)
            self.storage.offloaded.await_tier_writes()
        self.reserve_graphed_step(plan)
        key = self.graphed.prepare_recording(plan, self.rerank_due(plan))
        self.finish_graphed_step(plan)
        return key

    def reserve_graphed_step(self, plan: AppendPlan) -> None:
        self.storage.reserve_graphed_step(plan)

    def make_graphed_step_room(self, plan: AppendPlan) -> None:
        self.storage.make_graphed_step_room(plan)

    def graph_storage_key(self, plan: AppendPlan) -> tuple:
        """The storage a recorded decode of the step ``plan`` reads (see :meth:`begin_graphed_step`)."""
        return self.graphed.recording_launch(plan)[1]

    def prepare_device_step(self, plan: AppendPlan) -> bool:
        return self.graphed.prepare_device_step(plan)

    @property
    def plans_own_step(self) -> bool:
        """Whether this layer's decode reads a FlashInfer plan of its own (its split of the pages, head_budgets)."""
        return self.storage.row_pages_key is not None

    def finish_graphed_step(self, plan: AppendPlan) -> None:
        """The host bookkeeping of a graphed step that no device work reads (counters, rerank phase, the stored
        chunk): may run while the GPU replays the step."""
        self._count_decode_step(plan)
        self.num_chunks += 1

    # ----------------------------------------------------------------------------------------- read back, stats

    def read_logical(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every stored token read back exactly, in logical positions: ``[B, H, L, D]`` (padding is zero)."""
        return self.storage.read_logical(self.sequence.logical_valid()[:, : self.get_seq_length()])

    def stats(self) -> dict[str, int]:
        """Byte counts and work counters of this layer (see :meth:`FlexiCache.stats`)."""
        if not self.is_initialized or self.num_chunks == 0:
            return {}
        storage = self.storage
        token_bytes = 2 * storage.head_dim * storage.dtype.itemsize  # K + V, one head
        stats = {**storage.byte_counts(self.sequence.num_tokens_host),
                 "reranks_unstable": self.unstable_reranks, "reranks_stable": 0,
                 "promoted_pages": 0, "bytes_h2d": 0, "bytes_d2h": 0,
                 "dense_kv_bytes": storage.batch_size * self.num_kv_heads * self.get_seq_length() * token_bytes}
        if storage.offloaded is not None:
            counters = storage.offloaded.counters
            stats["reranks_stable"] = counters.reranks
            stats["promoted_pages"] = int(counters.promoted_pages)
            stats["bytes_h2d"] = int(counters.bytes_h2d)
            stats["bytes_d2h"] = counters.bytes_d2h
        return stats


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` without its autograd history where it has one (the storage never joins an autograd graph)."""
    return tensor.detach() if tensor.requires_grad else tensor
