"""Per-request token bookkeeping shared by all layers, and the append plan of one forward pass.

``generate`` left-pads batches, so a request's *logical* positions (what the attention mask and
``get_seq_length`` count) include pad tokens that never enter a page. ``SequenceState`` tracks, per request,
which logical positions hold real tokens and how many real tokens there are; every layer of one forward
appends the same chunk, so the indices of that append are computed once (:class:`AppendPlan`) and shared.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
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
    memo: dict = field(default_factory=dict, repr=False)  # per-step values derived once and shared by layers
    _per_device: dict = field(default_factory=dict, repr=False)

    @property
    def num_new_pages(self) -> int:
        return self.new_page_batch.numel()

    @property
    def max_pages_after(self) -> int:
        """Pages of the longest request after the chunk."""
        return int((self.after_host.max().item() + self.page_size - 1) // self.page_size)

    def on(self, device: torch.device) -> AppendPlan:
        """This plan with its device tensors on ``device`` (cached; layers may live on different devices)."""
        if self.batch.device == device:
            return self
        if device not in self._per_device:
            moved = {
                name: getattr(self, name).to(device)
                for name in ("batch", "chunk_pos", "page", "offset", "new_page_batch", "new_page_index", "before", "after")
            }
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
        self.logical_length = 0
        self.num_tokens: torch.Tensor | None = None  # [B] long, on the device
        self.num_tokens_host: torch.Tensor | None = None  # [B] long, on the CPU
        self.num_chunks = 0
        self.last_plan: AppendPlan | None = None
        self.next_decode_plan: AppendPlan | None = None  # peek_decode_plan's, for chunk number num_chunks

    @property
    def batch_size(self) -> int:
        return 0 if self.num_tokens is None else self.num_tokens.shape[0]

    def plan_chunk(self, chunk_index: int, valid: torch.Tensor | None, batch_size: int, length: int,
                   device: torch.device) -> AppendPlan:
        """The plan of chunk number ``chunk_index``: computed by the first layer that asks, reused by the others.

        Args:
            chunk_index: how many chunks the asking layer has appended before this one.
            valid: ``[B, T]`` bool, True for real tokens; ``None`` means all real.
        """
        if chunk_index == self.num_chunks - 1 and self.last_plan is not None:
            return self.last_plan.on(device)
        if chunk_index != self.num_chunks:
            raise RuntimeError(
                f"FlexiCache layers went out of step (layer at chunk {chunk_index}, cache at {self.num_chunks}); "
                "every decoder layer must run once per forward pass."
            )
        self.last_plan = self._advance(valid, batch_size, length, device)
        self.num_chunks += 1
        return self.last_plan

    def _advance(self, valid: torch.Tensor | None, batch_size: int, length: int, device: torch.device) -> AppendPlan:
        if self.num_tokens is None:
            self.num_tokens = torch.zeros(batch_size, dtype=torch.long, device=device)
            self.num_tokens_host = torch.zeros(batch_size, dtype=torch.long)
            self.valid = torch.zeros(batch_size, max(64, 2 * length), dtype=torch.bool)
        if batch_size != self.batch_size:
            raise ValueError(
                f"FlexiCache holds a batch of {self.batch_size} requests, got {batch_size}: call cache.reset() "
                "(or build a new FlexiCache) before starting another batch."
            )
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
        counts = end_new - first_new
        new_page_batch = torch.arange(batch_size).repeat_interleave(counts)
        starts = torch.cumsum(counts, 0) - counts
        new_page_index = first_new.repeat_interleave(counts) + torch.arange(int(counts.sum())) - starts.repeat_interleave(counts)
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
        if end > self.valid.shape[1]:
            grown = torch.zeros(self.batch_size, 2 * end, dtype=torch.bool)
            grown[:, :start] = self.valid[:, :start]
            self.valid = grown
        self.valid[:, start:end] = True if valid is None else valid
        self.logical_length = end

    def logical_valid(self) -> torch.Tensor:
        """``[B, logical_length]`` bool on the CPU: which logical positions hold real tokens."""
        return self.valid[:, : self.logical_length]
