"""Whole-step CUDA graph wrapper (flexicache.step_graph) off the GPU: installed by from_model, transparent where it
cannot record, removable. Its recording logic is checked on the CPU in test_triton_interpreted.py (emulated
graphs) and on the GPU in test_gpu_flashinfer.py (real graphs against eager generation)."""

from __future__ import annotations

import contextlib
import copy
import gc
import inspect
import pickle
import warnings
import weakref

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from flexicache import FlexiCache, disable_step_graphs, enable_step_graphs, forward_guard, warn_once
from flexicache.sequence import SequenceState
from flexicache.step_graph import StepGraphs, StepGraphStore, calling_model


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return LlamaForCausalLM(config).eval()


def generate(model, cache, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=12,
                              do_sample=False)


def test_from_model_installs_a_transparent_wrapper_and_disable_restores_the_forward() -> None:
    model = tiny_model()
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    cache = FlexiCache.from_model(model, token_budget=32)
    assert isinstance(model.forward, StepGraphs)
    assert "input_ids" in inspect.signature(model.forward).parameters  # generate() reads the forward's signature
    wrapped = generate(model, cache, ids)
    assert cache.stats()["step_graph_replays"] == cache.stats()["step_graph_captures"] == 0  # CPU: eager steps
    dynamic = generate(model, DynamicCache(config=model.config), ids)  # other caches pass through
    disable_step_graphs(model)
    assert "forward" not in vars(model) and model.forward.__func__ is LlamaForCausalLM.forward
    assert torch.equal(wrapped, generate(model, FlexiCache(model.config, token_budget=32), ids))
    assert torch.equal(dynamic, generate(model, DynamicCache(config=model.config), ids))


def test_a_wrapped_model_is_freed_by_reference_counting_and_copies_with_its_own_forward() -> None:
    """The wrapper in the model's ``__dict__`` holds no reference to the model (no cycle that only the garbage
    collector breaks, which on a GPU would hold the weights), and a deep copy or a pickled model wraps its own
    forward."""
    model = tiny_model()
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(1))
    expected = generate(model, FlexiCache.from_model(model, token_budget=32), ids)
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert isinstance(copied.forward, StepGraphs) and copied.forward.eager_forward.__self__ is copied
        assert torch.equal(generate(copied, FlexiCache.from_model(copied, token_budget=32), ids), expected)
    gc.collect()
    gc.disable()
    try:
        freed = weakref.ref(model)
        del model
        assert freed() is None
    finally:
        gc.enable()


def test_enable_is_idempotent_and_cuda_graphs_false_installs_nothing() -> None:
    model = tiny_model()
    FlexiCache.from_model(model, cuda_graphs=False)
    assert "forward" not in vars(model)
    wrapper = enable_step_graphs(model)
    assert enable_step_graphs(model) is wrapper and wrapper.eager_forward.__func__ is LlamaForCausalLM.forward


def test_a_replayed_output_is_a_copy_of_every_tensor() -> None:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from flexicache.step_graph import _copied_output

    logits = torch.ones(2, 1, 4)
    output = CausalLMOutputWithPast(logits=logits, past_key_values=None)
    copy = _copied_output(output)
    logits.zero_()  # the next replay overwrites the recorded output
    assert type(copy) is CausalLMOutputWithPast and torch.equal(copy.logits, torch.ones(2, 1, 4))
    nested = _copied_output((logits, [logits], None))
    assert nested[0] is not logits and nested[1][0] is not logits and nested[2] is None


def test_a_step_of_another_batch_size_runs_eagerly_and_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-token step whose batch differs from the cache's never reaches a graph (whose kernels would index past
    the cache's per-request buffers): the eager path refuses it with the cache's own message."""
    from flexicache import step_graph

    model = tiny_model()
    cache = FlexiCache.from_model(model, token_budget=32)
    with torch.inference_mode():
        model(input_ids=torch.randint(0, 256, (2, 40)), past_key_values=cache)
    monkeypatch.setattr(StepGraphStore, "ready", lambda self: True)  # as if on the GPU path
    monkeypatch.setattr(step_graph, "run_graphed_step", lambda *args: pytest.fail("a graph ran the step"))
    with torch.inference_mode(), pytest.raises(ValueError, match="holds a batch of 2 requests, got 3"):
        model(input_ids=torch.randint(0, 256, (3, 1)), past_key_values=cache)


def test_a_forward_that_cannot_be_captured_falls_back_to_eager_steps(monkeypatch) -> None:
    """A capture that fails (e.g. the forward reads a device value on the host) keeps the step's eager output,
    warns once and switches the cache to eager steps; nothing half-recorded stays."""
    import contextlib

    from flexicache import step_graph

    class Stream:
        def wait_stream(self, other) -> None:
            pass

    def failing_capture(launch, device, pool=None):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(step_graph, "capture_stream", lambda device: Stream())
    monkeypatch.setattr(step_graph, "capture", failing_capture)
    cache = FlexiCache(tiny_model().config)
    recording = []
    def forward(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        recording.append(cache.layers[0].recording)
        return inputs["input_ids"] + 1

    with pytest.warns(RuntimeWarning, match="cannot be captured"):
        output = step_graph._record(cache.step_graphs, ("key",), cache,
                                    {"input_ids": torch.ones(1, 1, dtype=torch.long)}, forward)
    assert torch.equal(output, torch.full((1, 1), 2)) and recording == [True]  # the step ran, recorded-mode
    assert cache.step_graphs.eager_reason is not None and not cache.step_graphs.steps
    assert cache.step_graphs.captures == 0 and not cache.layers[0].recording


def test_begin_step_host_time_script_runs() -> None:
    """eval/begin_step_host_time.py (it patches the cache's CUDA parts, so it runs in its own process)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root / "src"), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(root / "eval" / "begin_step_host_time.py"), "--layers", "2",
                             "--batch", "2"], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "begin step, 2 layers, batch 2: p50" in result.stdout


class RecordingGraph:
    """Stands in for ``torch.cuda.CUDAGraph``: notes whether garbage collection was on at the capture's ends."""

    def __init__(self) -> None:
        self.gc_enabled: list[bool] = []

    def capture_begin(self, pool=None) -> None:
        self.gc_enabled.append(gc.isenabled())

    def capture_end(self) -> None:
        self.gc_enabled.append(gc.isenabled())


class FakeStream:
    def wait_stream(self, other) -> None:
        pass


@pytest.mark.parametrize("fails", [False, True])
def test_capture_keeps_garbage_collection_off_while_recording(monkeypatch: pytest.MonkeyPatch, fails: bool) -> None:
    """A collection during a capture could free an earlier cache's graphs or pinned buffers: CUDA calls that
    invalidate the capture. Collection is off from the capture's start to its end and back on after (also when the
    recorded work raises); it stays off if the caller had it off."""
    from flexicache import decode_graph

    graphs: list[RecordingGraph] = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: graphs.append(RecordingGraph()) or graphs[-1])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(decode_graph, "capture_stream", lambda device: FakeStream())
    seen: list[bool] = []

    def launch() -> None:
        seen.append(gc.isenabled())
        if fails:
            raise RuntimeError("capture failed")

    for collecting in (True, False):
        (gc.enable if collecting else gc.disable)()
        try:
            with pytest.raises(RuntimeError) if fails else contextlib.nullcontext():
                decode_graph.capture(launch, torch.device("cuda", 0))
            assert gc.isenabled() is collecting
        finally:
            gc.enable()
    assert seen == [False, False] and [graph.gc_enabled for graph in graphs] == [[False, False], [False, False]]


def test_a_cache_run_through_the_wrapper_is_marked_driven_and_a_plain_one_is_not() -> None:
    model = tiny_model()
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    plain = FlexiCache(model.config, token_budget=32)
    model.set_attn_implementation("flexicache")
    generate(model, plain, ids)
    assert not plain.step_graphs.driven
    wrapped = FlexiCache.from_model(model, token_budget=32)
    generate(model, wrapped, ids)
    assert wrapped.step_graphs.driven


class _CudaLayer:
    """A stand-in layer on ``cuda:0`` (only its device is read)."""

    recording = False
    is_initialized = True
    device = torch.device("cuda", 0)


class _DecodeKeys:
    """Stand-in decode keys ``[B, H, 1, D]`` on ``cuda:0`` (shape and device only: no GPU here)."""

    shape = (2, 2, 1, 16)
    device = torch.device("cuda", 0)


def hint_store(driven: bool, enabled: bool, refusal: str | None) -> StepGraphStore:
    store = StepGraphStore([_CudaLayer(), _CudaLayer()], SequenceState(page_size=16), enabled=enabled,
                           refusal=refusal)
    store.driven = driven
    return store


def forward(self, store: StepGraphStore, keys: _DecodeKeys) -> None:
    """Stands in for a model's ``forward`` frame (``self`` the model) that reaches a cache's ``update``."""
    forward_guard.adopt_unwrapped_forward(store, keys)


@pytest.mark.parametrize("case", ["plain", "no model", "layer by layer", "wrapped elsewhere", "driven",
                                  "cuda_graphs off", "refused", "prefill chunk", "second step"])
def test_the_first_decode_step_from_an_unwrapped_forward_on_one_gpu_wraps_the_calling_model(
        monkeypatch, case: str) -> None:
    """The plain path (``FlexiCache(config)`` on a model whose forward enable_step_graphs never wrapped) on one GPU
    wraps the forward of the model that called the cache, at its first decode step, silently; where no model calls
    it (or one whose forward is wrapped already, i.e. not the caller), it warns once per process and names what to
    call. Nothing where whole-step graphs are on or cannot run, for a model set to layer by layer, or at later steps."""
    monkeypatch.setattr(warn_once, "GIVEN", set())
    model = tiny_model()
    if case == "layer by layer":
        disable_step_graphs(model)
    if case == "wrapped elsewhere":
        enable_step_graphs(model)
    store = hint_store(driven=case == "driven", enabled=case != "cuda_graphs off",
                       refusal="hybrid" if case == "refused" else None)
    keys = _DecodeKeys()
    if case == "prefill chunk":
        keys.shape = (2, 2, 40, 16)
    if case == "second step":
        forward(model, store, keys)
        model.forward = type(model).forward.__get__(model)  # unwrapped again: a later step must not look
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if case == "no model":
            forward_guard.adopt_unwrapped_forward(store, keys)
        else:
            forward(model, store, keys)
    messages = [str(warning.message) for warning in caught]
    if case in ("no model", "wrapped elsewhere"):
        assert len(messages) == 1 and "FlexiCache.from_model(model" in messages[0]
        assert "enable_step_graphs(model)" in messages[0] and "cuda_graphs=False" in messages[0]
    else:
        assert messages == []
    assert isinstance(model.forward, StepGraphs) == (case in ("plain", "wrapped elsewhere"))


def test_a_plain_cache_finds_the_outermost_model_calling_it() -> None:
    """``calling_model`` seen from a cache's ``update`` during ``generate``: the causal LM, not its inner model."""
    model = tiny_model()
    model.set_attn_implementation("flexicache")
    found = []

    class Spy(FlexiCache):
        def update(self, *args, **kwargs):
            found.append(calling_model())
            return super().update(*args, **kwargs)

    generate(model, Spy(model.config, token_budget=32), torch.randint(0, 256, (1, 40)))
    assert found and all(model_found is model for model_found in found)
    assert calling_model() is None
