"""Stable heads: the full KV in a host tier, only a working set of pages plus the tail page on the device.

Per row (request, stable head) the device holds ``K + C`` slots: ``K - 1 + C`` for a *working set* of full pages (the
sink among them) and the last one for the tail page (the page being written, 1..ps tokens); ``K`` is the pages a head
attends to, ``C`` its standby pages (``standby_pages``; the cache's ``"auto"`` is ``K``, within
``MAX_WORKING_SET_SLOTS``). Full pages live in the host tier. A rerank
scores every full page from the device-resident min/max metadata, takes the top ``K - 1 + C`` as the working set and
copies only the newly promoted pages to the device; a tail page that fills is copied to the host and takes over a
working-set slot until the next rerank decides. At every decode step a head attends to its working set's ``K - 1``
best pages for that step's query (all of them without standby pages) and its tail page: between two reranks the
selection follows the queries among the pages already on the device, and no step copies anything.

A host tier narrower than the KV (``host_dtype="float8_e4m3fn"``) stores each key less its row's centre (the
per-channel median of the request's first-chunk keys for that head, in fp32, fp64 for fp64 KV): a head's
per-channel offsets, large in some models, would otherwise take the few mantissa bits its variation needs.
Promotions add the centre back.

On CUDA with Triton, page moves between the pinned host tier and the device run as zero-copy kernels
(:mod:`flexicache.backends.triton_transfer`) driven by device-side indices: reranks, promotions and tail
retirements never synchronise the host with the device. Elsewhere they use torch indexing.

A prompt's first chunk (on that path) is written into a device copy of the tier's layout (*staged*) and reaches the
tier by asynchronous copies on a side stream, so the link's transfer (the whole prompt's stable KV) runs while the
next layers compute. The commit's tail refresh and first rerank read the staged copy; it is dropped when the commit
ends (:meth:`OffloadedPages.release_staged`), and every later use of the tier waits for the copies first
(:meth:`OffloadedPages.await_tier_writes`, on the device: the host is never blocked).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from flexicache import host_tier
from flexicache.backends import triton_available
from flexicache.host_tier import HostTier, to_tier_dtype
from flexicache.paging import PagePool
from flexicache.selection import attended_slots, update_selection
from flexicache.sequence import AppendPlan, host_to_device, per_row


def zero_copy_available(device: torch.device) -> bool:
    """Whether page moves between the host tier and ``device`` run as zero-copy Triton kernels (CUDA + Triton)."""
    return device.type == "cuda" and triton_available()


@functools.cache
def tier_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream that copies staged prompt chunks into host tiers on ``device`` (one per device)."""
    return torch.cuda.Stream(device)


@dataclass
class TransferCounters:
    """Host <-> device traffic and rerank work of one layer's stable heads.

    ``promoted_pages`` and ``bytes_h2d`` may be 0-d device tensors (counted without a sync); read them with
    ``int()``.
    """

    reranks: int = 0  # row reranks (one row = one request x one head)
    promoted_pages: int = 0
    bytes_h2d: int = 0
    bytes_d2h: int = 0


class OffloadedPages:
    """Device slots, selection state and host tier of the stable heads of one layer.

    The rows' ``B * h * (K + C)`` device slots are one range of the layer's :class:`PagePool` starting at ``base``:
    the slot of (row ``r``, position ``j``) is ``base + r * (K + C) + j``, the tail's ``j = K + C - 1``;
    ``selected``: ``[B * h, K - 1 + C]`` page held by each working-set slot (``-1`` = empty);
    ``selected_scores``: ``[B * h, K - 1 + C]`` score of that page at the last rerank or, with standby pages, at the
    last decode step (``+inf`` = keep: the sink, a retired tail until it is scored);
    ``key_centre``: ``[B * h, D]`` what the host tier's keys are stored less (a narrower tier only, else ``None``);
    ``staged``: a first prompt chunk's ``(k, v)`` on the device, ``[B, h, P, ps, D]`` in the tier's dtype (``P``: the
    chunk's pages per row), until its commit ends;
    ``tier_written``: the event after the side stream's copies of the staged chunk into the tier (``None``: none
    pending).
    """

    def __init__(self, pool: PagePool, batch_size: int, num_heads: int, pages_per_head: int, page_size: int,
                 host_pages: int = 0, host_dtype: torch.dtype | None = None, standby_pages: int = 0) -> None:
        self.pool = pool
        self.num_heads = num_heads
        self.pages_per_head = pages_per_head  # K: pages attended per row, the tail included
        self.slots_per_row = pages_per_head + standby_pages  # K + C: device slots per row, the tail included
        self.page_size = page_size
        rows = batch_size * num_heads
        self.base = pool.allocate(rows * self.slots_per_row)
        device, dtype, head_dim = pool.k.device, pool.k.dtype, pool.k.shape[-1]
        self.selected = torch.full((rows, self.slots_per_row - 1), -1, dtype=torch.long, device=device)
        self.selected_scores = torch.full((rows, self.slots_per_row - 1), float("-inf"), device=device)
        self.all_requests = torch.arange(batch_size, device=device)
        self.host = HostTier(batch_size, num_heads, page_size, head_dim, host_dtype or dtype,
                             pin_memory=host_tier.pins_host_tier(device), capacity=host_pages)
        self.key_centre = None if self.host.k.dtype == dtype else torch.zeros(
            rows, head_dim, dtype=torch.promote_types(dtype, torch.float32), device=device)
        self.counters = TransferCounters()
        self.steps_since_rerank = 0
        self.steps_since_prompt = 0  # decode steps since the last prompt chunk (the rerank warm-up)
        self.zero_copy = zero_copy_available(device)
        self.staged: tuple[torch.Tensor, torch.Tensor] | None = None
        self.tier_written: torch.cuda.Event | None = None
        if self.zero_copy:  # counted on the device, in place (a whole-step CUDA graph replays the additions)
            self.counters.promoted_pages = torch.zeros((), dtype=torch.long, device=device)
            self.counters.bytes_h2d = torch.zeros((), dtype=torch.long, device=device)

    @property
    def num_rows(self) -> int:
        return self.selected.shape[0]

    @property
    def nbytes_reserved(self) -> int:
        """Bytes of this class's device slots."""
        return self._page_bytes(self.num_rows * self.slots_per_row)

    @property
    def standby_pages(self) -> int:
        """C: working-set slots per row beyond the ``K - 1`` a row attends to."""
        return self.slots_per_row - self.pages_per_head

    def _rows_of(self, batch: torch.Tensor) -> torch.Tensor:
        """``[n * h]`` rows (``b * h + head``) of requests ``batch [n]``."""
        return (batch.unsqueeze(1) * self.num_heads + torch.arange(self.num_heads, device=batch.device)).reshape(-1)

    def _host_page_index(self, batch: torch.Tensor, page: torch.Tensor) -> torch.Tensor:
        """``[n * h]`` index into the tier's pages (:meth:`_tier_pages`) of page ``page [n]`` of every row of requests
        ``batch [n]``."""
        return self._rows_of(batch) * self._tier_pages_per_row() + per_row(page, self.num_heads)

    def _tail_slots_of(self, batch: torch.Tensor) -> torch.Tensor:
        """``[n * h]`` tail slots of the rows of requests ``batch [n]``."""
        return self.base + self._rows_of(batch) * self.slots_per_row + self.slots_per_row - 1

    def _page_bytes(self, num_pages: int) -> int:
        """Bytes of ``num_pages`` device pages (keys and values)."""
        return 2 * num_pages * self.pool.k.shape[1] * self.pool.k.shape[2] * self.pool.k.element_size()

    def host_page_bytes(self, num_pages: int) -> int:
        """Bytes of ``num_pages`` host pages (keys and values): what moving them between host and device carries."""
        return 2 * num_pages * self.pool.k.shape[1] * self.pool.k.shape[2] * self.host.k.element_size()

    # ----------------------------------------------------------------------------------------------- append

    def retire_full_tails(self, batch: torch.Tensor, plan: AppendPlan) -> None:
        """Decode step: requests ``batch [n]`` (device) whose tail page is full move it out before their next token.

        The page goes to the host tier and takes over a selection slot (an empty one, else the lowest-scored page
        but never the sink; the first such slot on ties) until the next rerank. On CUDA with Triton this is one
        kernel launch (:func:`~flexicache.backends.triton_transfer.retire_tails`).
        """
        self._reserve_host(int(plan.before_host.max()) // self.page_size)
        self.await_tier_writes()
        if self.zero_copy:
            from flexicache.backends.triton_transfer import retire_tails

            retire_tails(self._device_pages(), self.host.pages(), self.selected, self.selected_scores, batch,
                         plan.before, self.base, self.num_heads, self.host.k.shape[2], self.page_size,
                         centre=self.key_centre)
            self.counters.bytes_d2h += self.host_page_bytes(batch.numel() * self.num_heads)
            return
        page = (plan.before[batch] - 1) // self.page_size  # [n] the full tail page of each request
        tail_slots = self._tail_slots_of(batch)
        self._offload_tails(batch, page, tail_slots)
        rows = self._rows_of(batch)
        # Victim: an empty slot first, else the lowest-scored page. The sink (page 0) is never evicted: earlier
        # retired tails (score +inf until the next rerank) rank just below it, and a row whose one working-set slot
        # holds the sink keeps its page on the host until the next rerank (its copy below lands on itself).
        selected = self.selected[rows]
        keep = self.selected_scores[rows].clamp(max=torch.finfo(self.selected_scores.dtype).max)
        keep = keep.masked_fill(selected == 0, float("inf")).masked_fill(selected < 0, float("-inf"))
        lowest = keep.min(dim=1, keepdim=True).values
        victim = (keep == lowest).int().argmax(dim=1)  # the first slot holding the minimum
        evictable = lowest.squeeze(1) < float("inf")
        target = torch.where(evictable, self.base + rows * self.slots_per_row + victim, tail_slots)
        self.pool.k[target] = self.pool.k[tail_slots]
        self.pool.v[target] = self.pool.v[tail_slots]
        held = self.selected[rows, victim]
        self.selected[rows, victim] = torch.where(evictable, per_row(page, self.num_heads), held)
        self.selected_scores[rows, victim] = torch.where(evictable, float("inf"), self.selected_scores[rows, victim])

    def make_retirement_room(self, full_pages: int) -> None:
        """Host-tier room for :meth:`retire_full_tails_on_device` at a step where the longest request has
        ``full_pages`` full pages."""
        self._reserve_host(full_pages)

    def count_retirement(self, num_full: int) -> None:
        """The transfer count of a :meth:`retire_full_tails_on_device` where ``num_full`` requests retire."""
        self.counters.bytes_d2h += self.host_page_bytes(num_full * self.num_heads)

    def retire_full_tails_on_device(self, before: torch.Tensor) -> None:
        """:meth:`retire_full_tails` for every request whose tail page is full, decided on the device from
        ``before [B]`` (tokens before this step): one launch at every step (zero-copy path only)."""
        from flexicache.backends.triton_transfer import retire_tails

        self.await_tier_writes()
        retire_tails(self._device_pages(), self.host.pages(), self.selected, self.selected_scores,
                     self.all_requests, before, self.base, self.num_heads, self.host.k.shape[2], self.page_size,
                     full_only=True, centre=self.key_centre)

    def tail_slots(self) -> torch.Tensor:
        """``[B, h]`` tail slot of every row."""
        batch_size = self.num_rows // self.num_heads
        return self._tail_slots_of(torch.arange(batch_size, device=self.pool.k.device)).view(batch_size, -1)

    def _offload_tails(self, batch: torch.Tensor, page: torch.Tensor, tail_slots: torch.Tensor) -> None:
        """Copy the tail slots ``[n * h]`` of requests ``batch [n]`` to host page ``page [n]`` (one per request)."""
        self._to_host(tail_slots, self._host_page_index(batch, page), torch.ones_like(tail_slots, dtype=torch.bool))
        self.counters.bytes_d2h += self.host_page_bytes(batch.numel() * self.num_heads)

    def _device_pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool.k, self.pool.v

    def _to_device(self, host_index: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> None:
        """``pool[slots[i]] = host page host_index[i]`` (keys and values) where ``mask[i]``: cast to the KV dtype,
        the keys' centre added back."""
        self._move(self._tier_pages(), self._device_pages(), host_index, slots, mask, 1)

    def _to_host(self, slots: torch.Tensor, host_index: torch.Tensor, mask: torch.Tensor) -> None:
        """``host page host_index[i] = pool[slots[i]]`` where ``mask[i]``: the keys less their centre, cast to the
        tier's dtype."""
        self.await_tier_writes()
        self._move(self._device_pages(), self.host.pages(), slots, host_index, mask, -1)

    def _move(self, source: tuple[torch.Tensor, torch.Tensor], target: tuple[torch.Tensor, torch.Tensor],
              source_index: torch.Tensor, target_index: torch.Tensor, mask: torch.Tensor, centre_sign: int) -> None:
        """Pages between the tier and the device; ``centre_sign`` +1: from the tier (its index is the source's),
        -1: to it."""
        pages_per_row = self._tier_pages_per_row()
        if self.zero_copy:
            from flexicache.backends.triton_transfer import copy_pages

            copy_pages(source, target, source_index, target_index, mask, self.key_centre, centre_sign, pages_per_row)
            return
        chosen = mask.nonzero().view(-1)
        source_index = source_index[chosen].to(source[0].device)
        target_index = target_index[chosen].to(target[0].device)
        keys = source[0][source_index].to(target[0].device)
        if self.key_centre is not None:
            host_index = source_index if centre_sign > 0 else target_index
            centre = self.key_centre[host_index.to(self.key_centre.device) // pages_per_row].to(target[0].device)
            keys = keys.to(centre.dtype) + centre_sign * centre.unsqueeze(1)
        target[0][target_index] = to_tier_dtype(keys, target[0].dtype)
        target[1][target_index] = to_tier_dtype(source[1][source_index].to(target[1].device), target[1].dtype)

    def _host_keys(self, keys: torch.Tensor, requests: torch.Tensor) -> torch.Tensor:
        """``keys [N, h, D]`` of requests ``requests [N]`` as the host tier stores them (less their centre)."""
        if self.key_centre is None:
            return keys
        centre = self.key_centre.view(-1, self.num_heads, keys.shape[-1])[requests]
        return keys.to(centre.dtype) - centre

    def _set_key_centre(self, new_keys: torch.Tensor, plan: AppendPlan) -> None:
        """A narrower tier's centre for every request whose first chunk ``new_keys [N, h, D]`` (plan order: request
        by request) is: the per-channel median of its real keys, per head (a median, not a mean: one token with a
        massive key, such as an attention sink, would drag a mean far enough to saturate the whole channel). Per
        request, not an atomic scatter: the same values on every run and path."""
        if self.key_centre is None:
            return
        centre = self.key_centre.view(-1, self.num_heads, new_keys.shape[-1])
        counts = (plan.after_host - plan.before_host).tolist()  # host copies: no device sync
        for request, (keys, first) in enumerate(zip(new_keys.split(counts), (plan.before_host == 0).tolist())):
            if first and keys.shape[0]:
                centre[request].copy_(keys.to(centre.dtype).median(dim=0).values)  # in place: graphs read it

    def _reserve_host(self, num_pages: int) -> None:
        """Grow the host tier; on the zero-copy path (kernels read and write the tier in place) wait first for those
        that may still use the old one."""
        if num_pages > self.host.k.shape[2] > 0 and self.zero_copy:
            torch.cuda.synchronize(self.pool.k.device)
        self.host.reserve(num_pages)

    def append_chunk(self, new_keys: torch.Tensor, new_values: torch.Tensor, plan: AppendPlan) -> None:
        """Several tokens (prefill or extend, ``[N, h, D]`` in plan order): everything goes to the host tier.

        The caller reranks right after, which fills the selection slots, then calls :meth:`release_staged`; the tail
        slot is refreshed here. A first chunk on the zero-copy path is staged (see the module's docstring).
        """
        self.release_staged()  # a commit that raised may have left one: it must not be read or written again
        self._reserve_host(plan.max_pages_after)
        self.await_tier_writes()
        device = self.pool.k.device
        started = host_to_device((plan.before_host > 0).nonzero().view(-1), device)
        if started.numel():  # the old tail page may be partial and exist on the device only
            self._offload_tails(started, (plan.before[started] - 1) // self.page_size, self._tail_slots_of(started))
        self.counters.bytes_d2h += 2 * new_keys.numel() * self.host.k.element_size()
        self._set_key_centre(new_keys, plan)
        if self.zero_copy:  # the device writes the tokens into the pinned tier (and reads the tails back): no sync
            from flexicache.backends.triton_transfer import write_tokens

            staged = not bool(plan.before_host.any()) and self._stage(plan.max_pages_after)
            write_tokens(new_keys, new_values, self._tier_pages(), plan.batch, plan.page, plan.offset,
                         self._tier_pages_per_row(), centre=self.key_centre)
            if staged:
                self._copy_staged_to_tier()
        else:
            batch_host, page_host, offset_host = plan.batch.cpu(), plan.page.cpu(), plan.offset.cpu()
            self.host.k[batch_host, :, page_host, offset_host] = to_tier_dtype(
                self._host_keys(new_keys, plan.batch), self.host.k.dtype).cpu()
            self.host.v[batch_host, :, page_host, offset_host] = to_tier_dtype(new_values, self.host.v.dtype).cpu()
        requests = host_to_device((plan.after_host > 0).nonzero().view(-1), device)
        tail_slots = self._tail_slots_of(requests)
        self._to_device(self._host_page_index(requests, (plan.after[requests] - 1) // self.page_size), tail_slots,
                        torch.ones_like(tail_slots, dtype=torch.bool))
        self._count_copied_to_device(requests.numel() * self.num_heads)

    def _stage(self, num_pages: int) -> bool:
        """Make :attr:`staged` for a first chunk of ``num_pages`` pages per row (the same bytes the tier gets, written
        on the device first); ``False`` where the device has no room for it (the chunk is then written straight into
        the tier, as a later chunk is)."""
        shape = (*self.host.k.shape[:2], num_pages, *self.host.k.shape[3:])
        try:
            self.staged = (torch.empty(shape, dtype=self.host.k.dtype, device=self.pool.k.device),
                           torch.empty(shape, dtype=self.host.v.dtype, device=self.pool.k.device))
        except torch.OutOfMemoryError:
            return False
        return True

    def _copy_staged_to_tier(self) -> None:
        """Copy the staged pages into the first pages of every tier row (:meth:`HostTier.copy_from`): on CUDA queued
        on the side stream (after the current stream's work so far), :attr:`tier_written` recorded after them;
        elsewhere at once."""
        device = self.pool.k.device
        side = tier_stream(device) if device.type == "cuda" else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            self.host.copy_from(*self.staged)
        if side is None:
            return
        for staged in self.staged:
            staged.record_stream(side)  # its blocks are reused only once the copies are done
        self.tier_written = torch.cuda.Event()
        self.tier_written.record(side)

    def release_staged(self) -> None:
        """The commit that staged a first chunk has ended: later reads of the tier wait for its copies."""
        self.staged = None

    def await_tier_writes(self) -> None:
        """Order the current stream's next work after the staged chunk's copies into the tier (if any are pending);
        no host sync. Call before any use of the tier outside the commit that staged them, and never while a CUDA
        graph is being captured (a step graph's host side calls it first)."""
        if self.tier_written is None:
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("FlexiCache internal error: a CUDA graph capture reached a host tier whose prompt "
                               "copies were not awaited before it.")
        torch.cuda.current_stream(self.pool.k.device).wait_event(self.tier_written)
        self.tier_written = None

    def _tier_pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tier's pages to read (:meth:`HostTier.pages`' layout): the staged chunk while its commit runs, else
        the tier itself, its pending copies awaited."""
        if self.staged is not None:
            shape = (-1, *self.staged[0].shape[3:])
            return self.staged[0].view(shape), self.staged[1].view(shape)
        self.await_tier_writes()
        return self.host.pages()

    def _tier_pages_per_row(self) -> int:
        """Pages per row of :meth:`_tier_pages`: the staged chunk's, else the tier's capacity."""
        return (self.host.k if self.staged is None else self.staged[0]).shape[2]

    # ----------------------------------------------------------------------------------------- crop, reorder

    def truncate(self, before: torch.Tensor, after: torch.Tensor) -> None:
        """A crop from ``before [B]`` to ``after [B]`` real tokens per request (CPU): selections of pages that are no
        longer full go; a request whose tail moves back to an earlier page gets it from the host tier into its tail
        slot (the host holds every full page). Device work only, ordered after the kernels that write the tier."""
        page_size, device = self.page_size, self.pool.k.device
        self.await_tier_writes()
        full_pages = per_row(host_to_device((after - 1).clamp(min=0) // page_size, device), self.num_heads)
        gone = self.selected >= full_pages.unsqueeze(1)
        self.selected.masked_fill_(gone, -1)  # in place: captured decode graphs read this storage
        self.selected_scores.masked_fill_(gone, float("-inf"))
        new_pages = (after + page_size - 1) // page_size
        moved = ((new_pages < (before + page_size - 1) // page_size) & (after > 0)).nonzero().view(-1)
        if moved.numel():
            batch, page = host_to_device(moved, device), host_to_device(new_pages[moved] - 1, device)
            tail_slots = self._tail_slots_of(batch)
            self._to_device(self._host_page_index(batch, page), tail_slots,
                            torch.ones_like(tail_slots, dtype=torch.bool))
            self._count_copied_to_device(moved.numel() * self.num_heads)

    def tail_keys(self, batch: torch.Tensor) -> torch.Tensor:
        """``[n, h, ps, D]`` keys in the tail slots of requests ``batch [n]``."""
        return self.pool.k[self._tail_slots_of(batch)].view(batch.numel(), self.num_heads, self.page_size, -1)

    def take_rows(self, source: OffloadedPages, index: torch.Tensor) -> None:
        """Hold the rows of requests ``index [B']`` (CPU) of ``source`` (another pool's): device slots, selections,
        host tier (copied request by request, no dense copy), counters and rerank phase."""
        device = self.pool.k.device
        rows = source._rows_of(index.to(device))  # [B' * h] source row of each new row, in order
        self.selected.copy_(source.selected[rows])
        self.selected_scores.copy_(source.selected_scores[rows])
        positions = torch.arange(self.slots_per_row, device=device)
        target = self.base + torch.arange(rows.numel(), device=device).view(-1, 1) * self.slots_per_row + positions
        held = source.base + rows.view(-1, 1) * self.slots_per_row + positions  # [B' * h, K + C] each
        self.pool.k[target] = source.pool.k[held]
        self.pool.v[target] = source.pool.v[held]
        if source.zero_copy:  # zero-copy kernels (and the side stream's copies) may still write the source tier
            torch.cuda.synchronize(device)
        _, _, capacity, page_size, head_dim = source.host.k.shape
        if self.host.k.shape[2] < capacity:  # the tier this pool was made with (sized by max_cache_len) is too small
            self.host = HostTier(index.numel(), self.num_heads, page_size, head_dim, source.host.k.dtype,
                                 source.host.pin_memory, capacity)
        for new_request, request in enumerate(index.tolist()):
            self.host.k[new_request, :, :capacity].copy_(source.host.k[request])
            self.host.v[new_request, :, :capacity].copy_(source.host.v[request])
        if source.key_centre is not None:
            self.key_centre.copy_(source.key_centre[rows])
        self.counters, self.steps_since_rerank = source.counters, source.steps_since_rerank
        self.steps_since_prompt = source.steps_since_prompt

    # ----------------------------------------------------------------------------------------------- rerank

    def rerank(self, scores: torch.Tensor, num_full_pages: torch.Tensor, max_promotions: int | None = None) -> None:
        """Select the top ``K - 1 + C`` full pages (sink forced) and copy only the newly promoted ones to the device.

        Device work only, no host state changes (the caller counts reranks): a CUDA graph may record it.

        Args:
            scores: ``[B * h, P]`` page scores (``P`` >= the longest row's full pages).
            num_full_pages: ``[B * h]`` full pages of each row (all pages but the tail).
            max_promotions: promote at most this many pages per row beyond its empty slots (``None``: no limit;
                :func:`~flexicache.selection.limit_promotions`).
        """
        if self.zero_copy:
            from flexicache.backends.triton_rerank import fits_fused_rerank, rerank_rows

            if fits_fused_rerank(scores, self.slots_per_row - 1):  # the same result as below, in two launches
                promoted = rerank_rows(scores.contiguous(), num_full_pages, self.selected, self.selected_scores,
                                       self._tier_pages(), self._device_pages(), self.base, self._tier_pages_per_row(),
                                       self.key_centre, max_promotions)
                self._count_promotions(promoted)
                return
        new_pages, promoted, target_cols, selected = update_selection(scores, num_full_pages, self.selected,
                                                                      max_promotions)
        working_slots = self.slots_per_row - 1
        rows = torch.arange(promoted.shape[0], device=promoted.device).unsqueeze(1)
        self._to_device((rows * self._tier_pages_per_row() + new_pages.clamp(min=0)).view(-1),
                        (self.base + rows * self.slots_per_row + target_cols.clamp(max=working_slots - 1)).view(-1),
                        promoted.view(-1))
        self._count_promotions(promoted.sum())
        self.selected.copy_(selected)  # in place: captured decode graphs read this storage
        page_scores = scores.gather(1, selected.clamp(min=0)).to(self.selected_scores.dtype)
        page_scores = page_scores.masked_fill(selected == 0, float("inf"))
        self.selected_scores.copy_(page_scores.masked_fill(selected < 0, float("-inf")))

    def _count_promotions(self, count: torch.Tensor) -> None:
        """Add ``count`` (a device tensor: no sync) promoted pages to the counters (in place on the zero-copy path:
        a whole-step CUDA graph replays the additions)."""
        count, counters = count.view(()), self.counters
        if self.zero_copy and torch.is_tensor(counters.promoted_pages):
            counters.promoted_pages.add_(count)
            counters.bytes_h2d.add_(count * self.host_page_bytes(1))
        else:
            counters.promoted_pages = counters.promoted_pages + count
            counters.bytes_h2d = counters.bytes_h2d + count * self.host_page_bytes(1)

    def _count_copied_to_device(self, num_pages: int) -> None:
        """Add ``num_pages`` pages copied to the device outside a rerank (in place where the counter is)."""
        if self.zero_copy and torch.is_tensor(self.counters.bytes_h2d):
            self.counters.bytes_h2d.add_(self.host_page_bytes(num_pages))
        else:
            self.counters.bytes_h2d = self.counters.bytes_h2d + self.host_page_bytes(num_pages)

    # ----------------------------------------------------------------------------------------------- decode

    def held_pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slots, page_lens)``, both ``[B * h, K - 1 + C]``: every row's working-set slots on the device and the
        tokens each holds (a full page, or 0 for an empty slot)."""
        return self._row_slots()[:, :-1], (self.selected >= 0).long() * self.page_size

    def _row_slots(self) -> torch.Tensor:
        """``[B * h, K + C]`` every row's device slots: its working set, then its tail slot."""
        device = self.pool.k.device
        columns = torch.arange(self.slots_per_row, device=device)
        return self.base + torch.arange(self.num_rows, device=device).view(-1, 1) * self.slots_per_row + columns

    def decode_pages(self, last_page_len: torch.Tensor, scores: torch.Tensor | None = None,
                     row_pages: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slots, page_lens)``, both ``[B * h, K]``: the working-set slots a row attends to, then its tail slot
        (the last listed). Device work only. (``scores=None`` only without standby pages, where ``K + C = K``.)

        Args:
            last_page_len: ``[B * h]`` tokens in each row's tail page.
            scores: ``[B * h, K - 1 + C]`` this step's score of each working-set slot's page, with standby pages
                (:func:`~flexicache.selection.attended_slots` picks the ``K - 1`` attended ones, and the scores
                replace ``selected_scores``); ``None`` without: every held slot is attended.
            row_pages: ``[B * h]`` each row's own ``K`` (``head_budgets="prompt"``, at most ``K + C``; with
                ``scores``): the outputs are then ``[B * h, K + C]``, a row's entries beyond its own empty.
        """
        slots = self._row_slots()
        held = self.selected >= 0
        if scores is None:
            return slots, torch.cat([held.long() * self.page_size, last_page_len.view(-1, 1).long()], dim=1)
        self.selected_scores.copy_(scores.nan_to_num(nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))
                                   .masked_fill(self.selected == 0, float("inf")).masked_fill(~held, float("-inf")))
        count = self.pages_per_head if row_pages is None else row_pages
        attended = attended_slots(scores, self.selected, count - 1)
        # The attended slots first (in slot order), then the tail, then unused entries (length 0).
        listed = torch.cat([attended, torch.ones_like(attended[:, :1])], dim=1)
        order = (~listed).long().argsort(dim=1, stable=True)[:, :self.pages_per_head if row_pages is None else None]
        lengths = torch.cat([torch.full_like(slots[:, :-1], self.page_size), last_page_len.view(-1, 1).long()], 1)
        return slots.gather(1, order), (lengths * listed).gather(1, order)

    def read_tokens(self, num_pages: int, num_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, h, num_pages * ps, D]`` keys/values in token order on the device (host pages + tail slots).

        Args:
            num_tokens: ``[B]`` real tokens per request (CPU).
        """
        self._reserve_host(num_pages)
        self.await_tier_writes()
        device, dtype, head_dim = self.pool.k.device, self.pool.k.dtype, self.pool.k.shape[-1]
        batch_size = self.num_rows // self.num_heads
        if self.host.pin_memory:  # copies from the page-locked tier, ordered after the kernels that write it
            keys, values = self.host.to_device(num_pages, device)
        else:
            keys, values = (pages[:, :, :num_pages].to(device, copy=True, memory_format=torch.contiguous_format)
                            for pages in (self.host.k, self.host.v))
        if self.key_centre is not None:  # [B, h, P, ps, D] less the centre of each (request, head)
            keys = keys.to(self.key_centre.dtype) + self.key_centre.view(batch_size, self.num_heads, 1, 1, -1)
        keys, values = keys.to(dtype), values.to(dtype)
        nonempty = (num_tokens > 0).nonzero().view(-1)
        tail_page = ((num_tokens[nonempty] - 1) // self.page_size).to(device)
        nonempty = nonempty.to(device)
        tail_slots = self._tail_slots_of(nonempty)
        shape = (nonempty.numel(), self.num_heads, self.page_size, head_dim)
        keys[nonempty, :, tail_page] = self.pool.k[tail_slots].view(shape)  # the tail pages live on the device
        values[nonempty, :, tail_page] = self.pool.v[tail_slots].view(shape)
        tokens = (batch_size, self.num_heads, -1, head_dim)
        return keys.view(tokens), values.view(tokens)
