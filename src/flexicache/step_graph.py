"""Whole decode steps of a model with a FlexiCache replayed as CUDA graphs.

transformers issues a decode step as thousands of small kernel launches from Python: for an 8B-shaped model about
30 ms of host time per step, more than the GPU needs for the step at a long context with FlexiCache. With
:func:`enable_step_graphs` (``FlexiCache.from_model`` calls it), a decode step (one new token per request) on a
FlexiCache whose layers all run the CUDA path goes:

1. the cache's host bookkeeping for the step (:meth:`FlexiCache.begin_graphed_step`: token counts, pool slots
   and host-tier room for the pages the step opens and retires, counters, the FlashInfer plan, the static per-step
   inputs; the retirement and page opening themselves run in the graph);
2. the step's inputs (``input_ids``, ``position_ids``, ...) copied into static buffers, then one replay of a CUDA
   graph of the whole forward.

When the previous decode step also ran from a graph and nothing came between, step 1 shrinks to what the device
reads (:meth:`FlexiCache.prepare_replay`: the step's plan and static inputs, made while the previous step ran on the
GPU by :meth:`FlexiCache.prepare_next_step`; the layers' reservations only at a step that opens pages), and the rest
of the bookkeeping (:meth:`FlexiCache.finish_replay`) runs after the replay is launched, while the GPU works.

A graph is recorded for every new key: the shapes of the inputs, the other arguments, which layers rerank their
stable heads at this step (``rerank_interval`` phases) and the storage of every buffer the recorded work reads
(anything that reallocates, e.g. a page pool that grows, drops the cache's graphs and records again). At a step
with a new key the forward runs once eagerly (the step's real work) and is then captured for the later steps.
The ``attention_mask`` is not passed to the recorded forward (its width grows every step): at decode the
flexicache attention takes padding from the cache, not from the mask. Positions must be step inputs: when the
caller passes neither ``position_ids`` nor ``cache_position`` (a hand-written decode loop), they are made here from
the cache length, as the model would. Whatever else the forward computes on the host is frozen into the graph: a
forward that reads the device from the host (e.g. data-dependent control flow) cannot be captured, and the cache
then falls back to eager steps with a warning. Every other call (prefill, another cache, layers on the CPU or on
several GPUs, ``cuda_graphs=False``) runs the model's forward unchanged. Graphs belong to one cache: a new cache
records them again, so generations shorter than about two rerank intervals gain nothing.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from flexicache.decode_graph import capture, capture_stream

if TYPE_CHECKING:
    from flexicache.cache import FlexiCache


@dataclass
class RecordedStep:
    """A captured decode step: its graph, the static inputs it reads and the output it writes."""

    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    output: Any


class StepGraphStore:
    """One cache's recorded steps, keyed by :func:`_step_key`; all for one storage layout of the cache."""

    def __init__(self) -> None:
        self.steps: dict[tuple, RecordedStep] = {}
        self.storage: tuple | None = None
        self.chunk: int | None = None  # the cache's chunk count after the last step run here
        self.pool: tuple | None = None  # one memory pool shared by the graphs (replayed one at a time)
        self.captures = 0
        self.replays = 0
        self.disabled: str | None = None  # why this cache runs its steps eagerly (a forward that cannot be captured)

    def clear(self) -> None:
        """Drop every graph (their storage is gone: cache reset, rebuild or growth)."""
        self.steps.clear()
        self.storage = None
        self.chunk = None
        self.pool = None


class StepGraphs:
    """A model's ``forward`` that replays FlexiCache decode steps from CUDA graphs (see the module docstring)."""

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.eager_forward = forward
        functools.update_wrapper(self, forward)  # generate() inspects the forward's signature
        try:
            self.parameters = inspect.signature(forward).parameters
        except (TypeError, ValueError):  # no signature to read: positions must come from the caller
            self.parameters = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cache = _flexicache_of(kwargs)
        input_ids = kwargs.get("input_ids")
        if (args or cache is None or input_ids is None or input_ids.dim() != 2 or input_ids.shape[1] != 1
                or kwargs.get("inputs_embeds") is not None or cache.step_graphs.disabled is not None
                or input_ids.shape[0] != cache.sequence.batch_size  # the eager path says what is wrong
                or not cache.graphed_step_ready()):
            return self.eager_forward(*args, **kwargs)
        recorded_kwargs = {name: value for name, value in kwargs.items() if name != "attention_mask"}
        recorded_kwargs.update(self._missing_positions(recorded_kwargs, cache.get_seq_length(), input_ids.device))
        if recorded_kwargs.get("position_ids") is None and recorded_kwargs.get("cache_position") is None:
            return self.eager_forward(**kwargs)  # no way to hand the forward this step's position
        tensors = {name: value for name, value in recorded_kwargs.items() if torch.is_tensor(value)}
        others = tuple(sorted((name, value) for name, value in recorded_kwargs.items()
                              if not torch.is_tensor(value) and value is not cache))
        try:
            hash(others)
        except TypeError:  # an argument we cannot key a graph on: run this step eagerly
            return self.eager_forward(**kwargs)
        layout = tuple((name, tensor.shape, tensor.dtype, tensor.device) for name, tensor in sorted(tensors.items()))
        return run_graphed_step(cache, (id(self), layout, others), tensors,
                                lambda static: self.eager_forward(**{**recorded_kwargs, **static}))

    def _missing_positions(self, kwargs: dict[str, Any], past: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Positions the forward would derive on the host from the cache length (``past`` tokens before this one)
        and that must be step inputs instead: ``cache_position`` ``[1]`` where the forward takes it, and
        ``position_ids`` ``[1, 1]`` when the caller gave neither."""
        position = torch.arange(past, past + 1, device=device)
        missing = {}
        if kwargs.get("cache_position") is None and "cache_position" in self.parameters:
            missing["cache_position"] = position
        if (kwargs.get("position_ids") is None and kwargs.get("cache_position") is None
                and "position_ids" in self.parameters):
            missing["position_ids"] = position.unsqueeze(0)
        return missing


def run_graphed_step(cache: FlexiCache, key: tuple, tensors: dict[str, torch.Tensor],
                     forward: Callable[[dict[str, torch.Tensor]], Any]) -> Any:
    """One decode step of ``cache`` from a CUDA graph (call only when :meth:`FlexiCache.graphed_step_ready`).

    Does the step's host bookkeeping, then replays the graph recorded for ``key`` (what the caller's work depends
    on, e.g. input shapes) and the step's rerank phase, after copying ``tensors`` (the step's inputs) into its
    static inputs; or, for a new key, runs ``forward(static inputs)`` once and records it. When the previous
    decode step also ran here, only the bookkeeping the device reads precedes the replay, most of it made while
    the previous step ran on the GPU (:meth:`FlexiCache.prepare_next_step`); the rest runs while this one does
    (:meth:`FlexiCache.prepare_replay`, :meth:`FlexiCache.finish_replay`).

    Returns:
        ``forward``'s output, its tensors copied (the next replay overwrites the recorded ones).
    """
    store = cache.step_graphs
    if store.storage is not None and store.chunk == cache.sequence.num_chunks:  # nothing appended since
        prepared = cache.prepare_replay(store.storage)
        recorded = store.steps.get((key, prepared[0])) if prepared is not None else None
        if recorded is not None:
            output = _replay(store, recorded, tensors)
            cache.finish_replay(prepared[1])
            store.chunk = cache.sequence.num_chunks
            cache.prepare_next_step()
            return output
    rerank, storage = zip(*cache.begin_graphed_step())
    if storage != store.storage:  # something reallocated: the recorded graphs read freed memory
        store.clear()
        store.storage = storage
    key = (key, rerank)
    recorded = store.steps.get(key)
    output = _record(store, key, cache, tensors, forward) if recorded is None else _replay(store, recorded, tensors)
    store.chunk = cache.sequence.num_chunks
    if store.disabled is None:
        cache.prepare_next_step()
    return output


def _replay(store: StepGraphStore, recorded: RecordedStep, tensors: dict[str, torch.Tensor]) -> Any:
    for name, tensor in tensors.items():
        recorded.inputs[name].copy_(tensor)
    recorded.graph.replay()
    store.replays += 1
    return _detached(recorded.output)


def _record(store: StepGraphStore, key: tuple, cache: FlexiCache, tensors: dict[str, torch.Tensor],
            forward: Callable[[dict[str, torch.Tensor]], Any]) -> Any:
    """Run the prepared step once eagerly on the capture stream (the step's work, whose output is returned; it also
    warms that stream up, e.g. cuBLAS), then capture the same forward for the later steps."""
    inputs = {name: tensor.clone() for name, tensor in tensors.items()}
    device = next(iter(inputs.values())).device
    if store.pool is None:
        store.pool = torch.cuda.graph_pool_handle()
    current, stream = torch.cuda.current_stream(device), capture_stream(device)
    outputs: list[Any] = []
    with cache.recording():
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            output = forward(inputs)
        # The output was allocated on the capture stream and is read on the current one; its blocks are reused by
        # the capture stream only after the next wait_stream(current) above, so no record_stream is needed.
        current.wait_stream(stream)
        try:
            graph = capture(lambda: outputs.append(forward(inputs)), device, pool=store.pool)
        except RuntimeError as error:  # e.g. the forward reads a device value on the host (not capturable)
            store.clear()
            store.disabled = f"{type(error).__name__}: {error}"
            warnings.warn(f"FlexiCache: this model's decode step cannot be captured as a CUDA graph ({error}); "
                          "the cache runs its steps layer by layer from now on.", RuntimeWarning, stacklevel=3)
            return output
    store.steps[key] = RecordedStep(graph, inputs, outputs[0])
    store.captures += 1
    return output


def _flexicache_of(kwargs: dict[str, Any]) -> FlexiCache | None:
    from flexicache.cache import FlexiCache

    return next((value for value in kwargs.values() if isinstance(value, FlexiCache)), None)


def _detached(output: Any) -> Any:
    """A copy of a recorded output (a model output, tensor, sequence or ``None``) whose tensors the next replay
    does not overwrite."""
    if torch.is_tensor(output):
        return output.clone()
    if isinstance(output, (list, tuple)):
        return type(output)(_detached(item) for item in output)
    if hasattr(output, "items"):
        return type(output)(**{name: _detached(value) for name, value in output.items()})
    return output


def enable_step_graphs(model: torch.nn.Module) -> StepGraphs:
    """Make ``model.forward`` replay FlexiCache decode steps from CUDA graphs (idempotent); returns the wrapper.

    Calls without a FlexiCache, prefill chunks and caches that cannot record (CPU, several devices,
    ``cuda_graphs=False``) run the original forward. :func:`disable_step_graphs` restores it.
    """
    if not isinstance(model.forward, StepGraphs):
        model.forward = StepGraphs(model.forward)
    return model.forward


def disable_step_graphs(model: torch.nn.Module) -> None:
    """Undo :func:`enable_step_graphs`: the forward ``model`` had before (its class's, or a hook's) again."""
    if isinstance(model.forward, StepGraphs):
        original = model.forward.eager_forward
        if getattr(original, "__func__", None) is type(model).forward and original.__self__ is model:
            del model.forward
        else:
            model.forward = original
