"""Per-request token bookkeeping shared by all layers, and the append plan of one forward pass.

``generate`` left-pads batches, so a request's *logical* positions (what the attention mask and
``get_seq_length`` count) include pad tokens that never enter a page. ``SequenceState`` tracks, per request,
which logical positions hold real tokens and how many real tokens there are, and for the batch how many chunks and
decode steps it went through; every layer of one forward appends the same chunk, so the indices of that append are
computed once (:class:`AppendPlan`) and shared, with the values layers derive from them (computed by the first layer
that asks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from flexicache.backends.base import DecodeLayout, build_decode_layout


@dataclass(eq=False)  # compared by identity: one plan per chunk (and device), shared by the layers
class AppendPlan:
    """Where the real tokens of one chunk go. ``N`` = real tokens in the chunk, ``M`` = pages they open.

    Device tensors: ``batch``, ``chunk_pos``, ``page``, ``offset`` (``[N]``: request, position in the chunk,
    page and offset of every real token), ``new_page_batch``, ``new_page_index`` (``[M]``), ``before``,
    ``after`` (``[B]`` real tokens per request before/after the chunk). ``before_host``/``after_host`` are CPU
    copies used for sizing without a device sync.
    """

    page_size: int
    batch: torch.Tensor
    chunk_pos: torch.Tensor
    page: torch.Tensor
    offset: torch.Tensor
    new_page_batch: torch.Tensor
    new_page_index: torch.Tensor
    before: torch.Tensor
    after: torch.Tensor
    before_host: torch.Tensor
    after_host: torch.Tensor
    is_single_token: bool
    _per_device: dict[torch.device, AppendPlan] = field(default_factory=dict, repr=False)
    _row_offsets: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _layouts: dict[tuple, DecodeLayout] = field(default_factory=dict, repr=False)

    @property
    def num_new_pages(self) -> int:
        return self.new_page_batch.numel()

    @cached_property
    def max_pages_after(self) -> int:
        """Pages of the longest request after the chunk."""
        return int((self.after_host.max().item() + self.page_size - 1) // self.page_size)

    @cached_property
    def starts_empty_rows(self) -> bool:
        """Whether every request was empty before this chunk and gets the same number of real tokens ``n``: its
        tokens in plan order are then ``[B, n]`` row-major, the ``t``-th of a request at page ``t // page_size``,
        offset ``t % page_size`` (a prompt without padding)."""
        counts = self.after_host
        return (not self.is_single_token and not bool(self.before_host.any()) and bool((counts == counts[0]).all())
                and self.batch.numel() == counts.numel() * int(counts[0]))

    @cached_property
    def full_page_width(self) -> int:
        """Full pages of the longest request after the chunk (the score width a stable rerank needs)."""
        return int((self.after_host - 1).clamp(min=0).max()) // self.page_size

    @cached_property
    def full_tails(self) -> torch.Tensor:
        """``[B]`` bool (CPU): requests whose tail page filled up before this single-token step."""
        return (self.before_host > 0) & (self.before_host % self.page_size == 0)

    @cached_property
    def num_full_tails(self) -> int:
        return int(self.full_tails.sum())

    @cached_property
    def full_pages_before(self) -> int:
        """Full pages of the longest request before this single-token step (the host tier's room for retiring)."""
        return int(self.before_host.max()) // self.page_size

    @cached_property
    def full_tail_requests(self) -> torch.Tensor | None:
        """``[n]`` requests (on the plan's device) whose tail page filled up before this single-token step, or
        ``None`` if none did."""
        if not bool(self.full_tails.any()):
            return None
        return host_to_device(self.full_tails.nonzero().view(-1), self.batch.device)

    def row_offsets(self, num_heads: int) -> torch.Tensor:
        """``[B * num_heads]`` offset of this single-token step's token in each row (``b * H + h``)."""
        if num_heads not in self._row_offsets:
            self._row_offsets[num_heads] = per_row(self.offset, num_heads)
        return self._row_offsets[num_heads]

    def decode_layout(self, num_heads: int, pages_per_head: int, row_pages: tuple[int, ...] | None = None
                      ) -> DecodeLayout:
        """The row layout of this decode step (one object for every layer of the step: backends plan once), with
        ``row_pages`` (``B * H``) each row's own ``K`` (``head_budgets="prompt"``: one layout per layer)."""
        key = (num_heads, pages_per_head, row_pages)
        if key not in self._layouts:
            limits = None if row_pages is None else torch.tensor(row_pages)
            self._layouts[key] = build_decode_layout(self.after_host, num_heads, pages_per_head, self.page_size,
                                                     limits)
        return self._layouts[key]

    def on(self, device: torch.device) -> AppendPlan:
        """This plan with its device tensors on ``device`` (cached; layers may live on different devices)."""
        if self.batch.device == device:
            return self
        if device not in self._per_device:
            names = ("batch", "chunk_pos", "page", "offset", "new_page_batch", "new_page_index", "before", "after")
            moved = {name: getattr(self, name).to(device) for name in names}
            self._per_device[device] = AppendPlan(
                page_size=self.page_size,
                before_host=self.before_host,
                after_host=self.after_host,
                is_single_token=self.is_single_token,
                **moved,
            )
        return self._per_device[device]


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small CPU ``tensor`` on ``device``. On CUDA it is staged in pinned memory and copied asynchronously: a copy
    from pageable memory may make the host wait for the device, once per decode step."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def per_row(per_request: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[n * h]``: each value of ``per_request [n]`` repeated for its request's ``h`` rows (``b * h + head``); the
    output size is given, so on CUDA this does not wait for the device."""
    return per_request.repeat_interleave(num_heads, output_size=per_request.numel() * num_heads)


def expand_ranges(starts: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ranges ``starts[i] .. starts[i] + counts[i] - 1`` one after the other, for CPU ``starts, counts [n]``:
    ``(owner, value)``, both ``[counts.sum()]``, ``owner`` the index ``i`` of each value's range."""
    owner = torch.arange(counts.numel()).repeat_interleave(counts)
    first = torch.cumsum(counts, 0) - counts  # where each range starts in the output
    return owner, starts[owner] + torch.arange(owner.numel()) - first[owner]


class SequenceState:
    """Real-token bookkeeping of a batch: validity of logical positions and real-token counts per request.

    Layers may live on different devices (``device_map``): the validity stays on the CPU, where every layer can index
    its own tensors with it, and each plan is computed on the device of the layer that asks first.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.reset()

    def reset(self) -> None:
        self.valid: torch.Tensor | None = None  # [B, capacity] bool on the CPU, logical positions holding real tokens
        self.logical_length = 0  # logical positions of every chunk planned so far, padding included
        self.last_chunk_start = 0  # logical positions before the last planned chunk
        self.num_tokens: torch.Tensor | None = None  # [B] long, on the device
        self.num_tokens_host: torch.Tensor | None = None  # [B] long, on the CPU
        self.num_chunks = 0
        self.decode_steps = 0  # single-token decode steps planned (a prefill or a chunk of several tokens is none)
        self.last_plan: AppendPlan | None = None
        self.next_decode_plan: AppendPlan | None = None  # peek_decode_plan's, for chunk number num_chunks

    @property
    def batch_size(self) -> int:
        return 0 if self.num_tokens is None else self.num_tokens.shape[0]

    def check_batch(self, batch_size: int) -> None:
        """Refuse a chunk of ``batch_size`` requests when the cache holds another batch."""
        if self.num_tokens is not None and batch_size != self.batch_size:
            raise ValueError(
                f"FlexiCache holds a batch of {self.batch_size} requests, got {batch_size}: call cache.reset() "
                "(or build a new FlexiCache) before starting another batch."
            )

    def logical_length_after(self, num_chunks: int) -> int:
        """Logical positions of the first ``num_chunks`` chunks: what a layer that stored that many holds (a layer
        is at most one chunk behind the cache, while a forward runs through the layers)."""
        if num_chunks == self.num_chunks:
            return self.logical_length
        if num_chunks == self.num_chunks - 1:
            return self.last_chunk_start
        raise RuntimeError(self._out_of_step(num_chunks))

    def plan_chunk(self, chunk_index: int, valid: torch.Tensor | None, batch_size: int, length: int,
                   device: torch.device, decode: bool = False) -> AppendPlan:
        """The plan of chunk number ``chunk_index``: computed by the first layer that asks, reused by the others.

        Args:
            chunk_index: how many chunks the asking layer has appended before this one.
            valid: ``[B, T]`` bool, True for real tokens; ``None`` means all real.
            decode: the chunk is a decode step (counted in ``decode_steps``).
        """
        if chunk_index == self.num_chunks - 1 and self.last_plan is not None:
            return self.last_plan.on(device)
        if chunk_index != self.num_chunks:
            raise RuntimeError(self._out_of_step(chunk_index))
        self.last_plan = self._advance(valid, batch_size, length, device)
        self.num_chunks += 1
        self.decode_steps += decode
        return self.last_plan

    @torch.inference_mode(False)  # kept and written in place across calls, whatever grad mode they run in
    def crop(self, keep: int) -> None:
        """Forget the logical positions from ``keep`` on (``0 < keep <= logical_length``; no forward under way):
        every request keeps its real tokens among the first ``keep``."""
        self.valid[:, keep:self.logical_length] = False
        self.logical_length = self.last_chunk_start = keep
        self._set_counts(self.valid[:, :keep].sum(dim=1))

    @torch.inference_mode(False)
    def select(self, index: torch.Tensor) -> None:
        """Keep requests ``index [B']`` (CPU ``long``, any order, repeats allowed; no forward under way)."""
        self.valid = self.valid[index]
        self._set_counts(self.num_tokens_host[index])

    def _set_counts(self, num_tokens_host: torch.Tensor) -> None:
        self.num_tokens_host = num_tokens_host
        self.num_tokens = host_to_device(num_tokens_host, self.num_tokens.device)
        self.last_plan = self.next_decode_plan = None  # planned from the counts before

    def _out_of_step(self, chunk_index: int) -> str:
        return (f"FlexiCache layers went out of step (layer at chunk {chunk_index}, cache at {self.num_chunks}); "
                "every decoder layer must run once per forward pass.")

    def _advance(self, valid: torch.Tensor | None, batch_size: int, length: int, device: torch.device) -> AppendPlan:
        if self.num_tokens is None:
            self.num_tokens = torch.zeros(batch_size, dtype=torch.long, device=device)
            self.num_tokens_host = torch.zeros(batch_size, dtype=torch.long)
            with torch.inference_mode(False):  # written in place at every chunk, whatever grad mode it runs in
                self.valid = torch.zeros(batch_size, max(64, 2 * length), dtype=torch.bool)
        self.check_batch(batch_size)
        self._store_validity(valid, length)
        before, before_host = self.num_tokens.to(device), self.num_tokens_host
        peeked, self.next_decode_plan = self.next_decode_plan, None
        if valid is None and length == 1 and peeked is not None and peeked.batch.device == device:
            plan = peeked  # computed from this same state by peek_decode_plan
        elif valid is None and length == 1:
            plan = self._decode_plan(before, before_host, device)
        else:
            plan = self._chunk_plan(valid, before, before_host, length, device)
        self.num_tokens, self.num_tokens_host = plan.after, plan.after_host
        return plan

    def peek_decode_plan(self, device: torch.device) -> AppendPlan:
        """The plan the next chunk gets if it is one real token per request (a decode step), computed now without
        changing the state: :meth:`plan_chunk` takes it over unless another chunk comes first."""
        if self.next_decode_plan is None:
            self.next_decode_plan = self._decode_plan(self.num_tokens.to(device), self.num_tokens_host, device)
        return self.next_decode_plan

    def _chunk_plan(self, valid: torch.Tensor | None, before: torch.Tensor, before_host: torch.Tensor, length: int,
                    device: torch.device) -> AppendPlan:
        """The plan of ``length`` logical positions per request (``valid [B, T]``: which are real; ``None``: all)."""
        batch_size, page_size = before.shape[0], self.page_size
        if valid is None:  # arange and integer division: repeat_interleave on CUDA would wait for the device
            index = torch.arange(batch_size * length, device=device)
            batch, chunk_pos = index // length, index % length
            tokens = before[batch] + chunk_pos
            after, after_host = before + length, before_host + length
        else:
            batch, chunk_pos = valid.nonzero(as_tuple=True)
            rank = valid.long().cumsum(dim=1) - 1
            tokens = before[batch] + rank[batch, chunk_pos]
            added = valid.sum(dim=1)
            after, after_host = before + added, before_host + added.cpu()
        first_new = (before_host + page_size - 1) // page_size
        end_new = (after_host + page_size - 1) // page_size
        new_page_batch, new_page_index = expand_ranges(first_new, end_new - first_new)
        return AppendPlan(
            page_size=page_size,
            batch=batch,
            chunk_pos=chunk_pos,
            page=tokens // page_size,
            offset=tokens % page_size,
            new_page_batch=host_to_device(new_page_batch, device),
            new_page_index=host_to_device(new_page_index, device),
            before=before,
            after=after,
            before_host=before_host,
            after_host=after_host,
            is_single_token=valid is None and length == 1,
        )

    def _decode_plan(self, before: torch.Tensor, before_host: torch.Tensor, device: torch.device) -> AppendPlan:
        """:meth:`_chunk_plan` of one real token per request (a decode step) with fewer device launches and host ops,
        as the GPU waits for this at every step: each request writes at its count and opens a page where its count
        is a multiple of the page size."""
        batch_size, page_size = before.shape[0], self.page_size
        opening = (before_host % page_size == 0).nonzero().view(-1)
        if opening.numel():
            new_page_batch = host_to_device(opening, device)
            new_page_index = host_to_device(before_host[opening] // page_size, device)
        else:  # no copy to stage
            new_page_batch = new_page_index = torch.empty(0, dtype=torch.long, device=device)
        return AppendPlan(
            page_size=page_size,
            batch=torch.arange(batch_size, device=device),
            chunk_pos=torch.zeros(batch_size, dtype=torch.long, device=device),
            page=before // page_size,
            offset=before % page_size,
            new_page_batch=new_page_batch,
            new_page_index=new_page_index,
            before=before,
            after=before + 1,
            before_host=before_host,
            after_host=before_host + 1,
            is_single_token=True,
        )

    def _store_validity(self, valid: torch.Tensor | None, length: int) -> None:
        start, end = self.logical_length, self.logical_length + length
        self.last_chunk_start = start
        if end > self.valid.shape[1]:
            with torch.inference_mode(False):
                grown = torch.zeros(self.batch_size, 2 * end, dtype=torch.bool)
                grown[:, :start] = self.valid[:, :start]
            self.valid = grown
        self.valid[:, start:end] = True if valid is None else valid
        self.logical_length = end

    def logical_valid(self) -> torch.Tensor:
        """``[B, logical_length]`` bool on the CPU: which logical positions hold real tokens."""
        return self.valid[:, : self.logical_length]
