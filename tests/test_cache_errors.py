"""A cache after an error, and caches in threads: an exception inside a forward (a layer's decode, an interrupted
update, a graphed step's recording or capture) leaves either a working cache or one that refuses reuse with a clear
error until ``reset()``; caches on per-cache backends decode from several threads at once, caches sharing a backend
(FlashInfer's, emulated) are refused clearly while another thread's cache holds tokens."""

from __future__ import annotations

import contextlib
import threading
import warnings

import pytest
import torch
from conftest import greedy, left_pad, mixed_profile, random_prompt, tiny_config, tiny_model
from transformers import AttentionInterface

from flexicache import FlexiCache, decode_graph, handoff, step_graph, thread_claims
from flexicache.attention import ATTENTION_NAME, flexicache_attention_forward
from flexicache.backends import PreparedBackend, ReferenceBackend
from flexicache.layer import FlexiLayer
from flexicache.step_graph import StepGraphStore, SupportsStepGraphs, run_graphed_step

SETTINGS = {"token_budget": 16, "page_size": 4, "rerank_interval": 3}


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    return left_pad([random_prompt(30, seed=1), random_prompt(19, seed=2)])


def fresh_tokens(model, config, new_tokens: int = 8) -> torch.Tensor:
    ids, mask = batch()
    return greedy(model, ids, FlexiCache.from_model(model, profile=mixed_profile(config), **SETTINGS), mask, new_tokens)


def test_an_exception_inside_a_decode_step_is_refused_clearly_until_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    config = tiny_config(num_layers=3)
    model = tiny_model(config)
    expected = fresh_tokens(model, config)
    cache = FlexiCache.from_model(model, profile=mixed_profile(config), **SETTINGS)
    calls = {"count": 0}
    original = FlexiLayer.decode

    def failing(self, chunk, query, scale):
        if self.layer_idx == 1:
            calls["count"] += 1
            if calls["count"] == 4:  # the fourth decode step, after layer 0 stored its token
                raise RuntimeError("injected failure")
        return original(self, chunk, query, scale)

    monkeypatch.setattr(FlexiLayer, "decode", failing)
    ids, mask = batch()
    with pytest.raises(RuntimeError, match="injected failure"):
        greedy(model, ids, cache, mask, 8)
    monkeypatch.setattr(FlexiLayer, "decode", original)
    refusal = r"stopped part-way \(layers \[1, 2\] did not store the last chunk\).*cache\.reset\(\)"
    with pytest.raises(RuntimeError, match=refusal):
        greedy(model, ids, cache, mask, 8)
    with pytest.raises(RuntimeError, match=refusal):
        cache.crop(-1)
    with pytest.raises(RuntimeError, match=refusal):
        cache.batch_select_indices(torch.tensor([0]))
    cache.reset()
    assert torch.equal(greedy(model, ids, cache, mask, 8), expected)


def test_an_exception_before_any_layer_leaves_the_cache_working() -> None:
    """A failure outside the layers (here the embedding, at the fourth decode step) changes nothing in the cache:
    cropped back, it continues as if the failure had not happened."""
    config = tiny_config(num_layers=3)
    model = tiny_model(config)
    ids = random_prompt(20, seed=3).view(1, -1)
    cache = FlexiCache.from_model(model, profile=mixed_profile(config), token_budget=64, page_size=4)
    calls = {"count": 0}

    def hook(module, args):
        calls["count"] += 1
        if calls["count"] == 5:
            raise KeyboardInterrupt

    handle = model.model.embed_tokens.register_forward_pre_hook(hook)
    try:
        with pytest.raises(KeyboardInterrupt):
            greedy(model, ids, cache, None, 8)
    finally:
        handle.remove()
    assert cache.get_seq_length() == 20 + 3
    cache.crop(-4)  # back to all but the prompt's last token
    expected = greedy(model, ids, FlexiCache.from_model(model, profile=mixed_profile(config), token_budget=64,
                                                        page_size=4), None, 8)
    assert torch.equal(greedy(model, ids, cache, None, 8), expected)


def test_an_update_whose_attention_never_ran_is_reported_once_and_cleared(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward that stops between layer 0's cache update and its attention leaves a staged chunk: the next
    forward says so (and what to do); the one after works, and so does the cache after a reset."""
    config = tiny_config(num_layers=2)
    model = tiny_model(config)
    expected = fresh_tokens(model, config, 5)
    failures = {"left": 1}

    def interrupted(module, *args, **kwargs):
        if failures["left"] and module.layer_idx == 0:
            failures["left"] -= 1
            raise KeyboardInterrupt  # after the update staged its chunk, before the flexicache attention takes it
        return flexicache_attention_forward(module, *args, **kwargs)

    AttentionInterface.register(ATTENTION_NAME, interrupted)
    try:
        cache = FlexiCache.from_model(model, profile=mixed_profile(config), **SETTINGS)
        ids, mask = batch()
        with pytest.raises(KeyboardInterrupt):
            greedy(model, ids, cache, mask, 5)
        with pytest.raises(RuntimeError, match=r"updated in an earlier forward but never attended.*cache\.reset\(\)"):
            greedy(model, ids, cache, mask, 5)
        assert torch.equal(greedy(model, ids, cache, mask, 5), expected)
        cache.reset()
        assert torch.equal(greedy(model, ids, cache, mask, 5), expected)
    finally:
        AttentionInterface.register(ATTENTION_NAME, flexicache_attention_forward)


# ------------------------------------------------------------------- graphed steps and layer graphs (emulated)


class StepLayerStandIn:
    """A layer for the whole-step graph protocol that records nothing of its own."""

    recording = False
    device = torch.device("cpu")
    plans_own_step = False

    def graphed_step_ready(self, next_pages: int) -> bool:
        return True

    def graphed_step_plan(self):
        return None

    def begin_graphed_step(self):
        return False, ("storage",)

    def finish_graphed_step(self, plan) -> None:
        pass

    def prepare_device_step(self, plan) -> bool:
        return False

    def rerank_due(self, plan) -> bool:
        return False


class GraphedCacheStandIn(SupportsStepGraphs):
    """A cache of one request that holds 5 tokens, whose one layer is a :class:`StepLayerStandIn`."""

    def __init__(self) -> None:
        from flexicache.sequence import SequenceState

        sequence = SequenceState(4)
        sequence.plan_chunk(0, None, 1, 5, torch.device("cpu"))
        self.step_graphs = StepGraphStore([StepLayerStandIn()], sequence, enabled=True)


class ChunkTaker:
    """What the attention function calls on a layer (never called here: the chunk stays staged)."""


@pytest.fixture
def capture_on_cpu(monkeypatch: pytest.MonkeyPatch):
    """The CUDA calls around a graphed step's recording, as stand-ins; ``capture`` raises when told to."""
    stream = type("Stream", (), {"wait_stream": lambda self, other: None})()
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(step_graph, "capture_stream", lambda device: stream)
    behaviour = {"fail": False}

    def capture(launch, device, pool=None):
        launch()
        if behaviour["fail"]:
            raise RuntimeError("operation not permitted when stream is capturing")
        return type("Graph", (), {"replay": lambda self: None})()

    monkeypatch.setattr(step_graph, "capture", capture)
    return behaviour


def test_a_graphed_step_that_fails_is_refused_until_reset(capture_on_cpu) -> None:
    cache = GraphedCacheStandIn()
    inputs = {"input_ids": torch.zeros(1, 1, dtype=torch.long)}

    def failing(static):
        raise RuntimeError("out of memory in the recorded forward")

    with pytest.raises(RuntimeError, match="out of memory"):
        run_graphed_step(cache, ("key",), inputs, failing)
    assert not cache.step_graphs.layers[0].recording  # the recording flag is down again
    with pytest.raises(RuntimeError, match=r"graph failed \(RuntimeError: out of memory.*cache\.reset\(\)"):
        run_graphed_step(cache, ("key",), inputs, lambda static: "output")
    cache.step_graphs.reset()
    assert run_graphed_step(cache, ("key",), inputs, lambda static: "output") == "output"
    assert cache.step_graphs.captures == 1


def test_a_capture_that_fails_leaves_no_staged_chunk_and_runs_eagerly(capture_on_cpu) -> None:
    cache, taker = GraphedCacheStandIn(), ChunkTaker()
    capture_on_cpu["fail"] = True
    keys = torch.zeros(1, 1, 1, 4)

    def forward(static):  # a layer's update staged its chunk, then the capture failed
        handoff.stage(taker, 0, keys, keys, 5)
        handoff.take(0)
        handoff.stage(taker, 0, keys, keys, 5)
        return "output"

    inputs = {"input_ids": torch.zeros(1, 1, dtype=torch.long)}
    with pytest.warns(RuntimeWarning, match="cannot be captured"):
        assert run_graphed_step(cache, ("key",), inputs, forward) == "output"
    assert handoff.take(None) is None and cache.step_graphs.eager_reason is not None
    assert cache.step_graphs.failed is None
    assert not cache.step_graphs.steps


def test_recordings_after_the_first_capture_at_once_and_replay_for_the_step(capture_on_cpu) -> None:
    """The first recording on a cache's storage runs the step eagerly, then captures it (two forwards); a recording
    of another key after it captures at once and replays the graph for the step's work (one forward, the recorded
    output); new storage (e.g. a growth) runs its first recording eagerly again."""
    cache = GraphedCacheStandIn()
    store = cache.step_graphs
    calls = []

    def forward(static):
        calls.append(static["input_ids"].item())
        return {"logits": torch.full((1, 1, 2), float(len(calls))), "past_key_values": cache}

    def step(key: str, token: int):
        return run_graphed_step(cache, (key,), {"input_ids": torch.full((1, 1), token)}, forward)

    step("first phase", 5)
    assert calls == [5, 5] and store.steps and store.captures == 1 and store.replays == 0
    output = step("second phase", 6)
    assert calls == [5, 5, 6] and store.captures == 2 and store.replays == 1
    assert output["past_key_values"] is cache and torch.equal(output["logits"], torch.full((1, 1, 2), 3.0))
    store.clear()  # the storage changed
    step("first phase", 7)
    assert calls == [5, 5, 6, 7, 7] and store.captures == 3


def test_a_capture_at_once_that_fails_runs_the_step_and_warms_up_from_then_on(capture_on_cpu) -> None:
    cache = GraphedCacheStandIn()
    store = cache.step_graphs
    calls = []

    def forward(static):
        calls.append(1)
        return "output"

    inputs = {"input_ids": torch.zeros(1, 1, dtype=torch.long)}
    run_graphed_step(cache, ("first phase",), inputs, forward)
    capture_on_cpu["fail"] = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not the warning of a model that cannot be captured
        assert run_graphed_step(cache, ("second phase",), inputs, forward) == "output"
    assert len(calls) == 4  # the failed capture's forward, then the step's own
    assert not store.captures_at_once and store.eager_reason is None and store.failed is None and not store.steps
    capture_on_cpu["fail"] = False
    run_graphed_step(cache, ("first phase",), inputs, forward)
    run_graphed_step(cache, ("second phase",), inputs, forward)
    assert len(calls) == 8 and store.captures == 3  # each recording ran the step eagerly first


def test_a_layer_graph_that_cannot_be_captured_launches_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    graph = decode_graph.DecodeGraph(2, 2, 2, 8, torch.float32, torch.device("cpu"), capture=True)
    launches = []

    def refused(launch, device, pool=None):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(decode_graph, "capture", refused)
    with pytest.warns(RuntimeWarning, match="could not be captured"):
        assert graph.run(lambda: launches.append(1), ("storage",)) is graph.output
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graph.run(lambda: launches.append(2), ("storage",))  # eager from now on, without another attempt
    assert launches == [1, 2] and not graph.capture and graph.captures == 0


# ------------------------------------------------------------------------------------------------- threads


def run_in_thread(work, name: str = "worker"):
    """``work()`` in a new thread; returns its result or raises its exception here."""
    result: dict = {}

    def target() -> None:
        try:
            result["value"] = work()
        except BaseException as error:  # re-raised below
            result["error"] = error

    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join()
    if "error" in result:
        raise result.pop("error")  # unbound here: no frame of this traceback refers back to it (no cycle)
    return result["value"]


def test_caches_on_their_own_backends_decode_from_two_threads_at_once() -> None:
    config = tiny_config(num_layers=3)
    model = tiny_model(config)
    prompts = [left_pad([random_prompt(25 + seed, seed=seed), random_prompt(14, seed=seed + 10)]) for seed in (1, 2)]

    def generate(ids, mask):
        return greedy(model, ids, FlexiCache.from_model(model, profile=mixed_profile(config), **SETTINGS), mask, 12)

    expected = [generate(*prompt) for prompt in prompts]
    results: list = [None, None]
    barrier = threading.Barrier(2)

    def work(index: int) -> None:
        barrier.wait()  # both generations run at the same time
        results[index] = generate(*prompts[index])

    threads = [threading.Thread(target=work, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(torch.equal(got, want) for got, want in zip(results, expected))


class SharedBackendStandIn(ReferenceBackend):
    """A backend shared by caches, planned per step (as FlashInfer's is): the torch reference underneath."""

    def prepare(self, layout, group, head_dim, page_size, pages_per_head, dtype, scale):
        raise AssertionError("not on the CPU path")

    def run_prepared(self, planned, query, pool_k, pool_v, out=None):
        raise AssertionError("not on the CPU path")


def test_caches_sharing_a_backend_are_refused_while_another_threads_cache_holds_tokens() -> None:
    config = tiny_config(num_layers=2)
    model = tiny_model(config)
    shared = SharedBackendStandIn()
    assert isinstance(shared, PreparedBackend)

    def sharing():
        cache = FlexiCache.from_model(model, profile=mixed_profile(config), **SETTINGS)
        cache.backends[torch.device("cpu")] = shared
        return cache

    ids, mask = batch()
    expected = fresh_tokens(model, config, 6)
    ours = sharing()
    assert torch.equal(greedy(model, ids, ours, mask, 6), expected)
    assert thread_claims.holders(shared) == ["MainThread"]
    theirs = sharing()
    refusal = r"from thread 'worker' while another FlexiCache that holds tokens decodes there from thread 'MainThread'"
    with pytest.raises(RuntimeError, match=refusal + r".*cache\.close\(\) or cache\.reset\(\)"):
        run_in_thread(lambda: greedy(model, ids, theirs, mask, 6))
    ours.reset()  # gives the claim up
    assert torch.equal(run_in_thread(lambda: greedy(model, ids, theirs, mask, 6)), expected)
    with pytest.raises(RuntimeError, match="from thread 'MainThread' while another FlexiCache .* thread 'worker'"):
        greedy(model, ids, ours, mask, 6)
    theirs.close()
    assert torch.equal(greedy(model, ids, ours, mask, 6), expected)
    # one cache may move between threads: prefill here, decode on in a worker
    moving = sharing()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=moving)
    del ours
    more = run_in_thread(lambda: greedy(model, ids, moving, mask, 3))
    assert more.shape == (2, ids.shape[1] + 3)
