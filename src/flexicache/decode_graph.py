"""One layer's CUDA decode step (token append, page scoring, selection, sparse FlashInfer decode) as a CUDA graph.

Launched one by one from Python, the small kernels of a layer's decode step (append, the key-basis products, page
scoring, exact rescoring, selection, decode) cost more host time than the GPU spends on them. :class:`DecodeGraph`
captures them once and replays them at every later step. The captured kernels read every per-step value from storage
that never moves: the layer's static query/key/value buffers (filled by three copies per step), the device's
:class:`StepInputs` (filled once per step for all layers) and FlashInfer's plan buffers (filled by the step's
``plan()``). Whatever reallocates (page pool, page metadata or page table growth, a new plan wrapper) changes the
graph's storage key, and the next step re-captures.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable

import torch

from flexicache.sequence import AppendPlan


class StepInputs:
    """Per-step values of one device in storage that never moves: ``[4, B]`` int64 rows ``num_tokens`` (real
    tokens after the step's token), ``page`` and ``offset`` (where the step's token goes) and ``before`` (real
    tokens before it)."""

    @torch.inference_mode(False)  # made outside inference mode, like every buffer a cache keeps (flexicache.storage)
    def __init__(self, batch_size: int, device: torch.device) -> None:
        self.values = torch.zeros(4, batch_size, dtype=torch.long, device=device)
        self._loaded: AppendPlan | None = None

    def load(self, plan: AppendPlan) -> StepInputs:
        """Copy a single-token plan's values in (once per step: later calls with the same plan do nothing)."""
        if plan is not self._loaded:
            torch._foreach_copy_(list(self.values.unbind(0)), [plan.after, plan.page, plan.offset, plan.before])
            self._loaded = plan
        return self

    @property
    def num_tokens(self) -> torch.Tensor:
        return self.values[0]

    @property
    def page(self) -> torch.Tensor:
        return self.values[1]

    @property
    def offset(self) -> torch.Tensor:
        return self.values[2]

    @property
    def before(self) -> torch.Tensor:
        return self.values[3]


class DecodeGraph:
    """Static buffers of one layer's decode step and its captured CUDA graph.

    Args:
        batch_size, num_kv_heads, group, head_dim: ``B``, ``H``, ``G``, ``D``.
        capture: ``False`` launches the same kernels eagerly at every step (for debugging and comparison).
        bound_dtype: the dtype of the step's key and query turned into the page boxes' axes (principal_bounds;
            ``None``: not turned).
    """

    @torch.inference_mode(False)  # made outside inference mode, like every buffer a cache keeps (flexicache.storage)
    def __init__(self, batch_size: int, num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, capture: bool = True, bound_dtype: torch.dtype | None = None) -> None:
        self.keys = torch.zeros(batch_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.query = torch.zeros(batch_size * num_kv_heads, group, head_dim, dtype=dtype, device=device)
        self.output = torch.zeros_like(self.query)
        self.scores: torch.Tensor | None = None  # [B * hu, P] fp32 scratch, sized by the caller
        self.working_scores: torch.Tensor | None = None  # [B * hs, K - 1 + C] fp32 scratch, sized by the caller
        # The step's keys [B, H, D] and query [B * H, G, D] in the page boxes' axes, when they are turned.
        self.bound_keys = None if bound_dtype is None else torch.zeros_like(self.keys, dtype=bound_dtype)
        self.bound_query = None if bound_dtype is None else torch.zeros_like(self.query, dtype=bound_dtype)
        self.capture = capture
        self.captures = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._storage_key: tuple | None = None

    def load(self, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor) -> None:
        """Copy the step's ``keys``/``values`` ``[B, H, D]`` and ``query`` ``[B * H, G, D]`` in (one call: the host
        cost of a copy is mostly its dispatch)."""
        torch._foreach_copy_([self.keys, self.values, self.query], [keys, values, query])

    def run(self, launch: Callable[[], None], storage_key: tuple) -> torch.Tensor:
        """Replay the graph, or launch eagerly and capture for the next steps when ``storage_key`` changed.

        ``launch`` must read and write only this object's buffers and storage that ``storage_key`` identifies.
        Returns the output buffer ``[B * H, G, D]`` (overwritten by the next step).
        """
        if self._graph is not None and storage_key == self._storage_key:
            self._graph.replay()
            return self.output
        launch()  # this step's work; also compiles the kernels before any capture
        if self.capture:
            self._graph = None  # a failed capture below leaves no half-recorded graph to replay
            try:
                self._graph = capture(launch, self.output.device)  # a private pool: the kernels allocate nothing
            except RuntimeError as error:  # the step's work ran above: the layer goes on launching eagerly
                self.capture = False
                warnings.warn(f"FlexiCache: a layer's decode step could not be captured as a CUDA graph ({error}); "
                              "it launches its kernels one by one from now on.", RuntimeWarning, stacklevel=2)
                return self.output
            self._storage_key = storage_key
            self.captures += 1
        return self.output


def capture(launch: Callable[[], None], device: torch.device, pool: tuple | None = None) -> torch.cuda.CUDAGraph:
    """Record ``launch`` on a side stream (nothing runs) and order the current stream after it; ``pool``: a memory
    pool shared with other graphs (``None``: a private one)."""
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream(device)
    stream = capture_stream(device)
    stream.wait_stream(current)
    # A garbage collection inside the capture could destroy an earlier cache's graphs or release its pinned
    # buffers: CUDA calls that invalidate the capture (seen on the H200 when a second cache recorded its graphs).
    # This stops the cycle collector only; what ``launch`` frees by reference count must not touch CUDA state.
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool)
            try:
                launch()
            finally:
                graph.capture_end()
    finally:
        if collecting:
            gc.enable()
    current.wait_stream(stream)
    return graph


_streams: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream graphs of ``device`` are captured on (and warmed up on, where they need it)."""
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]
