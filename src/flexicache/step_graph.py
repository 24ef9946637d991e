"""Whole decode steps of a model with a FlexiCache replayed as CUDA graphs.

transformers issues a decode step as thousands of small kernel launches from Python: for an 8B-shaped model about
30 ms of host time per step, more than the GPU needs for the step at a long context with FlexiCache. With
:func:`enable_step_graphs` (``FlexiCache.from_model`` calls it), a decode step (one new token per request) on a
FlexiCache whose layers all run the CUDA path goes:

1. the cache's host bookkeeping for the step (:meth:`StepGraphStore.begin`: token counts, pool slots
   and host-tier room for the pages the step opens and retires, counters, the FlashInfer plan, the static per-step
   inputs; the retirement and page opening themselves run in the graph);
2. the step's inputs (``input_ids``, ``position_ids``, ...) copied into static buffers, then one replay of a CUDA
   graph of the whole forward.

When the previous decode step also ran from a graph and nothing came between, step 1 shrinks to what the device
reads (:meth:`StepGraphStore.prepare_replay`: the step's plan and static inputs, made while the previous step ran on
the GPU by :meth:`StepGraphStore.prepare_next_step`, as is the layers' room at a step that opens pages), and
the rest of the bookkeeping (:meth:`StepGraphStore.finish_replay`) runs after the replay is launched, while the GPU
works.

A graph is recorded for every new key: the shapes of the inputs, the other arguments, which layers rerank their
stable heads at this step (``rerank_interval`` phases) and the storage of every buffer the recorded work reads
(anything that reallocates, e.g. a page pool that grows, drops the cache's graphs and records again). At a step
with a new key the forward is captured for the later steps; the first such step on a cache's storage runs it once
eagerly before (the step's real work; it compiles the kernels of the storage's shapes), the later ones (the other
rerank phases) replay the fresh graph instead, which saves about 40% of their recording time.
The ``attention_mask`` is not passed to the recorded forward (its width grows every step): at decode the
flexicache attention takes padding from the cache, not from the mask. Positions must be step inputs: when the
caller passes neither ``position_ids`` nor ``cache_position`` (a hand-written decode loop), they are made here from
the cache length, as the model would. Whatever else the forward computes on the host is frozen into the graph: a
forward that reads the device from the host (e.g. data-dependent control flow) cannot be captured, and the cache
then falls back to eager steps with a warning. Every other call (prefill, another cache, layers on the CPU or on
several GPUs, ``cuda_graphs=False``, a model with sliding-window layers: :data:`HYBRID_REFUSAL`) runs the model's
forward unchanged. Graphs belong to one cache: a new cache records them again (measured on an H100 for the 8B shape
at 32 layers: about 120 ms for the first recording, 70 ms for each later one, against a replayed step's 13 ms), so
a generation pays about 1.2 s of recordings in its first 16 steps.

A cache takes part by deriving from :class:`SupportsStepGraphs` (its :class:`StepGraphStore` drives its layers through
the small :class:`StepLayer` protocol); this module imports no cache. A recorded step keeps its output without the
cache in it, so the graphs never keep their cache alive.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel

from flexicache import handoff
from flexicache.decode_graph import capture, capture_stream
from flexicache.sequence import AppendPlan, SequenceState
from flexicache.warn_once import warn_once


class StepLayer(Protocol):
    """What a cache layer does for a whole-step graph (:class:`~flexicache.layer.FlexiLayer` implements it)."""

    recording: bool  # while True, the layer only launches the device work begin_graphed_step prepared
    is_initialized: bool  # its storage exists (``device`` may be read)
    device: torch.device

    def graphed_step_ready(self, next_pages: int) -> bool: ...

    def graphed_step_plan(self) -> AppendPlan: ...  # the first layer's call of a step advances the sequence

    def begin_graphed_step(self) -> tuple[bool, tuple]: ...

    def reserve_graphed_step(self, plan: AppendPlan) -> None: ...

    def make_graphed_step_room(self, plan: AppendPlan) -> None: ...  # may run ahead of the step

    def graph_storage_key(self, plan: AppendPlan) -> tuple: ...

    def prepare_device_step(self, plan: AppendPlan) -> bool: ...

    @property
    def plans_own_step(self) -> bool: ...  # its decode reads a plan of its own, not the layers' shared one

    def rerank_due(self, plan: AppendPlan) -> bool: ...

    def finish_graphed_step(self, plan: AppendPlan) -> None: ...


@dataclass
class RecordedStep:
    """A captured decode step: its graph, the static inputs it reads and the output it writes (with the cache
    replaced by a placeholder, see :func:`_recordable`)."""

    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    output: Any


class StepGraphStore:
    """One cache's recorded steps (keyed by the step's inputs and work) and the host protocol of a graphed step
    over its ``layers`` and ``sequence``; all graphs are for one storage layout of the cache.

    Args:
        enabled: the cache's ``cuda_graphs`` setting.
        refusal: why this cache's steps never run from whole-step graphs (a hybrid model, see
            :data:`HYBRID_REFUSAL`), warned once per process at the first decode step on CUDA; ``None``: they may.
        max_length: logical positions past which steps run eagerly (the flexicache attention then checks the
            sequence against a window it must stay within); ``None``: no limit.
    """

    def __init__(self, layers: Sequence[StepLayer], sequence: SequenceState, enabled: bool,
                 refusal: str | None = None, max_length: int | None = None) -> None:
        self.layers = layers
        self.sequence = sequence
        self.enabled = enabled
        self.refusal = refusal
        self.max_length = max_length
        self.steps: dict[tuple, RecordedStep] = {}
        self.storage_layout: tuple | None = None
        self.chunks_seen: int | None = None  # the cache's chunk count after the last step run here
        self.pool: tuple | None = None  # one memory pool shared by the graphs (replayed one at a time)
        # once a step was captured on the current storage (steps is not empty), later recordings capture at once
        # (see _record) while this allows it (cleared for good by one that failed)
        self.captures_at_once = True
        self.captures = 0
        self.replays = 0
        # why this cache runs its steps eagerly (hybrid model, a forward that cannot be captured); None: it need not
        self.eager_reason = refusal
        self.failed: str | None = None  # an exception inside a graphed step left the cache's state incomplete
        self.next_reranks: tuple[AppendPlan, tuple[bool, ...]] | None = None  # prepare_next_step's, for its plan
        self.next_room: tuple[AppendPlan, tuple] | None = None  # its storage keys after the plan's room was made
        self.driven = False  # a model forward wrapped by enable_step_graphs has run with this cache
        self.unwrapped_seen = False  # a decode step came from a forward never wrapped (forward_guard's adoption)

    def clear(self) -> None:
        """Drop every graph (their storage is gone: cache reset, rebuild or growth)."""
        self.steps.clear()
        self.storage_layout = None
        self.chunks_seen = None
        self.pool = None

    def reset_after_failure(self) -> None:
        """Drop what a step that raised may have left: its graphs and a chunk staged for an attention that never
        ran (``failed`` stays set: the cache refuses further steps until it is reset)."""
        self.clear()
        handoff.clear_staged()

    def reset(self) -> None:
        """:meth:`clear`, and forget the next step prepared ahead and any failed step (the cache was reset)."""
        self.clear()
        self.next_reranks = self.next_room = None
        self.failed = None

    def ready(self) -> bool:
        """Whether the next decode step's device work can run from a whole-step CUDA graph: every layer, all on one
        CUDA device, ran a decode step on the CUDA graph path already (and can record the next one)."""
        if not (self.enabled and self.eager_reason is None and self.sequence.num_tokens_host is not None):
            return False
        if self.max_length is not None and self.sequence.logical_length >= self.max_length:
            return False
        page_size = self.sequence.page_size
        next_pages = (int(self.sequence.num_tokens_host.max()) + page_size) // page_size  # after one more token
        return all(layer.graphed_step_ready(next_pages) for layer in self.layers) and single_cuda_device(self.layers)

    def begin(self) -> tuple[tuple[bool, tuple], ...]:
        """Host side of the next decode step (all layers); its device work must then run from a graph recorded
        under :meth:`recording`. Returns each layer's key of that work (whether it reranks, the storage it reads)."""
        return tuple(layer.begin_graphed_step() for layer in self.layers)

    def prepare_replay(self, storage: tuple) -> tuple[tuple[bool, ...], AppendPlan] | None:
        """Before replaying a recorded step whose graphs read ``storage`` (the storage part of the last
        :meth:`begin`): the device side of the next step's host work (its shared inputs; where it opens pages, the
        layers' reservations), leaving the rest to :meth:`finish_replay`, which may run while the GPU replays.

        Returns:
            ``(which layers rerank their stable heads, the step's plan)``, or ``None`` when a graph recorded for
            ``storage`` would read stale buffers. Either way the step has begun (its plan is taken, its pages may
            be reserved): after ``None`` the caller must take :meth:`begin` (which reserves only what is not
            reserved yet) and record or replay.
        """
        layers = self.layers
        plan = layers[0].graphed_step_plan()
        if not all(layer.prepare_device_step(plan) for layer in self._planning_layers()):
            return None
        if plan.num_new_pages:  # only a step that opens pages reserves, and only its room can reallocate
            for layer in layers:
                layer.reserve_graphed_step(plan)  # its room made ahead: the slots and counts alone
            room = self.next_room
            keys = room[1] if room is not None and room[0] is plan else self._storage_keys(plan)
            if keys != storage:
                return None
        ahead = self.next_reranks
        reranks = ahead[1] if ahead is not None and ahead[0] is plan else self._reranks_due(plan)
        return reranks, plan

    def _planning_layers(self) -> list[StepLayer]:
        """The layers whose device inputs a step prepares: the first layer that reads the layers' shared plan (it
        also loads the step's shared inputs) and every layer with a plan of its own (its split of the pages,
        ``head_budgets="prompt"``); at least one layer."""
        own = [layer for layer in self.layers if layer.plans_own_step]
        shared = next((layer for layer in self.layers if not layer.plans_own_step), None)
        return own if shared is None else [shared, *own]

    def _reranks_due(self, plan: AppendPlan) -> tuple[bool, ...]:
        return tuple(layer.rerank_due(plan) for layer in self.layers)

    def _storage_keys(self, plan: AppendPlan) -> tuple:
        return tuple(layer.graph_storage_key(plan) for layer in self.layers)

    def finish_replay(self, plan: AppendPlan) -> None:
        """The host bookkeeping of a step prepared by :meth:`prepare_replay` that no device work reads."""
        for layer in self.layers:
            layer.finish_graphed_step(plan)

    def prepare_next_step(self) -> None:
        """Right after a graphed step is launched: the next decode step's plan and shared device inputs and, where
        it opens pages, the layers' room for them (:meth:`StepLayer.make_graphed_step_room`), made while the GPU
        works (their device writes queue behind the launched step). No state a caller sees changes but capacity
        reserved a step early: the next step takes them over if it is a decode step
        (:meth:`SequenceState.peek_decode_plan`), any other call recomputes its own (the room stays, unused)."""
        plan = self.sequence.peek_decode_plan(self.layers[0].device)
        for layer in self._planning_layers():
            layer.prepare_device_step(plan)
        self.next_reranks = (plan, self._reranks_due(plan))  # the rerank phase only moves with a step
        if plan.num_new_pages:  # the room for the pages it opens (about 1 ms of host work at 32 layers)
            for layer in self.layers:
                layer.make_graphed_step_room(plan)
            self.next_room = (plan, self._storage_keys(plan))

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """While a forward of the step prepared by :meth:`begin` is recorded (or run once): layers only launch
        device work and change no host state."""
        for layer in self.layers:
            layer.recording = True
        try:
            yield
        finally:
            for layer in self.layers:
                layer.recording = False


class SupportsStepGraphs:
    """A cache whose decode steps :class:`StepGraphs` may replay: it holds its :class:`StepGraphStore`."""

    step_graphs: StepGraphStore


HYBRID_REFUSAL = (
    "this model has sliding-window or chunked layers, and whole-step CUDA graphs cover models whose layers are all "
    "sparse paged: a sliding layer's window is a new tensor every step (a recorded graph would read freed memory) and "
    "its mask comes from the attention mask, which a recorded step does not take. Its decode steps run eagerly; the "
    "full-attention layers keep their per-layer CUDA graphs"
)


def _warn_refused(refusal: str, input_ids: torch.Tensor) -> None:
    """Warn once that a cache refuses whole-step graphs, at a decode step (one token per request) on CUDA."""
    if input_ids.device.type == "cuda" and input_ids.dim() == 2 and input_ids.shape[1] == 1:
        warn_once(f"FlexiCache: no whole-step CUDA graphs: {refusal}.", RuntimeWarning, stacklevel=3)


def single_cuda_device(layers: Sequence[StepLayer]) -> bool:
    """Whether every layer lives on one CUDA device (a graph is captured on one device)."""
    return layers[0].device.type == "cuda" and all(layer.device == layers[0].device for layer in layers)


class StepGraphs:
    """A model's ``forward`` that replays FlexiCache decode steps from CUDA graphs (see the module docstring).

    It sits in the model's ``__dict__`` and holds the model's own ``forward`` without a reference to the model (the
    model's method, its module held weakly): no reference cycle, so a dropped model is freed by reference counting;
    pickling or deep-copying the model wraps the copy's own ``forward``.
    """

    def __init__(self, forward: Callable[..., Any]) -> None:
        functools.update_wrapper(self, forward)
        del self.__wrapped__  # the bound method would refer to the model
        module = getattr(forward, "__self__", None)
        if isinstance(module, torch.nn.Module) and hasattr(forward, "__func__"):
            self._function, self._module, self._forward = forward.__func__, weakref.ref(module), None
        else:  # another callable (e.g. a hook's wrapper): held as it is
            self._function, self._module, self._forward = None, None, forward
        try:
            self.__signature__ = inspect.signature(forward)  # generate() inspects the forward's signature
            self.parameters = tuple(self.__signature__.parameters)
        except (TypeError, ValueError):  # no signature to read: positions must come from the caller
            self.parameters = ()

    @property
    def eager_forward(self) -> Callable[..., Any]:
        """The forward this wraps (the model's, bound to it again at each call)."""
        if self._forward is not None:
            return self._forward
        module = self._module()
        if module is None:
            raise ReferenceError("The model whose forward this StepGraphs wraps is gone.")
        return self._function.__get__(module)

    def __reduce__(self) -> tuple[Any, ...]:
        return StepGraphs, (self.eager_forward,)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cache = next((value for value in kwargs.values() if isinstance(value, SupportsStepGraphs)), None)
        if cache is not None:
            cache.step_graphs.driven = True
        input_ids = kwargs.get("input_ids")
        if cache is not None and cache.step_graphs.refusal is not None and torch.is_tensor(input_ids):
            _warn_refused(cache.step_graphs.refusal, input_ids)
        if (args or cache is None or input_ids is None or input_ids.dim() != 2 or input_ids.shape[1] != 1
                or kwargs.get("inputs_embeds") is not None or cache.step_graphs.eager_reason is not None
                or input_ids.shape[0] != cache.step_graphs.sequence.batch_size  # the eager path says what is wrong
                or not cache.step_graphs.ready()):
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


def run_graphed_step(cache: SupportsStepGraphs, key: tuple, tensors: dict[str, torch.Tensor],
                     forward: Callable[[dict[str, torch.Tensor]], Any]) -> Any:
    """One decode step of ``cache`` from a CUDA graph (call only when its ``step_graphs.ready()``).

    Does the step's host bookkeeping, then replays the graph recorded for ``key`` (what the caller's work depends
    on, e.g. input shapes) and the step's rerank phase, after copying ``tensors`` (the step's inputs) into its
    static inputs; or, for a new key, runs ``forward(static inputs)`` once and records it. When the previous
    decode step also ran here, only the bookkeeping the device reads precedes the replay, most of it made while
    the previous step ran on the GPU (:meth:`StepGraphStore.prepare_next_step`); the rest runs while this one does
    (:meth:`StepGraphStore.prepare_replay`, :meth:`StepGraphStore.finish_replay`).

    Returns:
        ``forward``'s output, its tensors copied (the next replay overwrites the recorded ones).
    """
    store = cache.step_graphs
    if store.failed is not None:
        raise RuntimeError(f"A previous decode step of this FlexiCache run as a CUDA graph failed ({store.failed}): "
                           "its state is incomplete. Call cache.reset() and generate again from the prompt.")
    try:
        # nothing appended since the last step run here
        if store.storage_layout is not None and store.chunks_seen == store.sequence.num_chunks:
            prepared = store.prepare_replay(store.storage_layout)
            recorded = store.steps.get((key, prepared[0])) if prepared is not None else None
            if recorded is not None:
                output = _replay(store, recorded, tensors, cache)
                store.finish_replay(prepared[1])
                store.chunks_seen = store.sequence.num_chunks
                store.prepare_next_step()
                return output
        rerank, storage = zip(*store.begin())
        if storage != store.storage_layout:  # something reallocated: the recorded graphs read freed memory
            store.clear()
            store.storage_layout = storage
        key = (key, rerank)
        recorded = store.steps.get(key)
        output = (_record(store, key, cache, tensors, forward) if recorded is None
                  else _replay(store, recorded, tensors, cache))
        store.chunks_seen = store.sequence.num_chunks
        if store.eager_reason is None:
            store.prepare_next_step()
        return output
    except BaseException as error:  # the step's host bookkeeping may have run without its device work
        store.failed = f"{type(error).__name__}: {error}"
        store.reset_after_failure()
        raise


def _replay(store: StepGraphStore, recorded: RecordedStep, tensors: dict[str, torch.Tensor], cache: Any) -> Any:
    for name, tensor in tensors.items():
        recorded.inputs[name].copy_(tensor)
    recorded.graph.replay()
    store.replays += 1
    return _copied_output(recorded.output, cache)


def _record(store: StepGraphStore, key: tuple, cache: Any, tensors: dict[str, torch.Tensor],
            forward: Callable[[dict[str, torch.Tensor]], Any]) -> Any:
    """Capture the prepared step for the later steps and do its work. The first recording on a cache's storage runs
    the step once eagerly on the capture stream first (its work, whose output is returned): that compiles the kernel
    variants of the storage's shapes, which a capture cannot, and warms the stream up (e.g. cuBLAS). A later one
    (another rerank phase) captures at once and replays the graph for the step's work: one forward of Python instead
    of two (each about half of a recording's time); should that capture fail, the step runs eagerly and every later
    recording of the cache runs the step eagerly before it captures."""
    with torch.inference_mode(False):  # each replay copies its step's inputs in, whatever grad mode it runs in
        inputs = {name: tensor.clone() for name, tensor in tensors.items()}
    device = next(iter(inputs.values())).device
    if store.pool is None:
        store.pool = torch.cuda.graph_pool_handle()
    current, stream = torch.cuda.current_stream(device), capture_stream(device)
    outputs: list[Any] = []
    warm = bool(store.steps) and store.captures_at_once
    with store.recording():
        if not warm:
            output = _run_on(stream, current, lambda: forward(inputs))
        try:
            graph = capture(lambda: outputs.append(forward(inputs)), device, pool=store.pool)
        except RuntimeError as error:  # e.g. the forward reads a device value on the host (not capturable)
            handoff.clear_staged()  # a layer's update recorded before the capture failed: nothing will take it
            store.clear()
            if warm:  # the step's work is still to do; every later recording runs eagerly before it captures
                store.captures_at_once = False
                return _run_on(stream, current, lambda: forward(inputs))
            store.eager_reason = f"{type(error).__name__}: {error}"
            warnings.warn(f"FlexiCache: this model's decode step cannot be captured as a CUDA graph ({error}); "
                          "the cache runs its steps layer by layer from now on.", RuntimeWarning, stacklevel=3)
            return output
    recorded = store.steps[key] = RecordedStep(graph, inputs, _recordable(outputs[0], cache))
    store.captures += 1
    return _replay(store, recorded, tensors, cache) if warm else output


def _run_on(stream: torch.cuda.Stream, current: torch.cuda.Stream, work: Callable[[], Any]) -> Any:
    """``work()`` on ``stream``, ordered after the ``current`` stream's work and before its next."""
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        output = work()
    # The output was allocated on the capture stream and is read on the current one; its blocks are reused by the
    # capture stream only after its next wait_stream(current), so no record_stream is needed.
    current.wait_stream(stream)
    return output


_CACHE = object()  # stands for the cache in a recorded output: the store's graphs must not keep their cache alive


def _rebuilt(output: Any, leaf: Callable[[Any], Any]) -> Any:
    """``output`` (a model output, sequence, tensor or other value) with ``leaf`` applied to every leaf."""
    if isinstance(output, (list, tuple)):
        return type(output)(_rebuilt(item, leaf) for item in output)
    if hasattr(output, "items"):
        return type(output)(**{name: _rebuilt(value, leaf) for name, value in output.items()})
    return leaf(output)


def _recordable(output: Any, cache: Any) -> Any:
    """A recorded output to keep: its tensors (the graph's, overwritten by each replay) and :data:`_CACHE` where
    ``cache`` was."""
    return _rebuilt(output, lambda value: _CACHE if value is cache else value)


def _copied_output(output: Any, cache: Any = None) -> Any:
    """A copy of a recorded output whose tensors the next replay does not overwrite, ``cache`` put back."""
    return _rebuilt(output, lambda value: value.clone() if torch.is_tensor(value) else cache if value is _CACHE
                    else value)


LAYER_BY_LAYER = "_flexicache_layer_by_layer"  # set on a model by disable_step_graphs: a plain cache leaves it as is


def enable_step_graphs(model: torch.nn.Module) -> StepGraphs:
    """Make ``model.forward`` replay FlexiCache decode steps from CUDA graphs (idempotent); returns the wrapper.

    Calls without a FlexiCache, prefill chunks and caches that cannot record (CPU, several devices,
    ``cuda_graphs=False``) run the original forward. :func:`disable_step_graphs` restores it.
    """
    vars(model).pop(LAYER_BY_LAYER, None)
    if not isinstance(model.forward, StepGraphs):
        model.forward = StepGraphs(model.forward)
    return model.forward


def disable_step_graphs(model: torch.nn.Module) -> None:
    """Undo :func:`enable_step_graphs`: the forward ``model`` had before (its class's, or a hook's) again, and its
    FlexiCache decode steps layer by layer from now on (a plain ``FlexiCache(config)`` then does not switch the model
    to whole-step graphs at its first decode step: :func:`flexicache.forward_guard.adopt_unwrapped_forward`)."""
    setattr(model, LAYER_BY_LAYER, True)
    if isinstance(model.forward, StepGraphs):
        original = model.forward.eager_forward
        if getattr(original, "__func__", None) is type(model).forward and original.__self__ is model:
            del model.forward
        else:
            model.forward = original


def calling_model() -> PreTrainedModel | None:
    """The outermost transformers model whose ``forward`` runs on this thread's stack (for a cache's ``update``:
    the model that called it), or ``None``."""
    found, frame = None, sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "forward" and isinstance(frame.f_locals.get("self"), PreTrainedModel):
            found = frame.f_locals["self"]
        frame = frame.f_back
    return found
