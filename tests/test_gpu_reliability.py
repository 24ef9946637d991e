"""On the GPU: the pinned host pool (reuse across caches, the limit refusing before memory is taken), crop and batch
operations without a dense rebuild (peak memory, state equal to the uncropped cache's, assisted generation), state
after a failed graphed step, and threads sharing the FlashInfer backend. The first two tests run eval/gpu_reliability.py
(its ``--help`` and a CPU smoke run) and need no GPU.

Run on the GPU host: ``pytest -q tests/test_gpu_reliability.py`` (and ``python eval/gpu_reliability.py`` for the
8B-shaped numbers).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import needs_fast_cuda_path
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from flexicache import FlexiCache, HeadProfile, host_pool
from flexicache.decode_paths import GraphedDecode
from flexicache.host_limits import HostMemoryError

EVAL = Path(__file__).resolve().parents[1] / "eval"


def run_script(*args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(EVAL.parent / "src"), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(EVAL / "gpu_reliability.py"), *args], env=env, capture_output=True,
                            text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout


def test_the_reliability_script_parses_its_arguments() -> None:
    assert "usage:" in run_script("--help")


def test_the_reliability_script_runs_on_the_cpu() -> None:
    out = run_script("--device", "cpu", "--shape", "tiny-llama", "--context", "120", "--batch", "2", "--budget", "32",
                     "--new-tokens", "18", "--requests", "2")
    assert "after request 2" in out and "request after it" in out and "RSS" in out


# ------------------------------------------------------------------------------------------------- GPU tests


def tiny_model(layers: int = 4) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=512, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=32768)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


PROFILE = HeadProfile(num_layers=4, num_kv_heads=2, head_dim=64, unstable_heads=[(0, 0), (2, 1)])


def generate(model, cache, ids: torch.Tensor, new_tokens: int = 40, **kwargs):
    with torch.inference_mode():
        return model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)


def with_logits(model, cache, ids: torch.Tensor, new_tokens: int = 40, **kwargs):
    return generate(model, cache, ids, new_tokens, output_logits=True, return_dict_in_generate=True, **kwargs)


def assert_same_generation(ours, theirs, min_steps: int) -> None:
    """Two generations (with their logits) agree: the same tokens for at least ``min_steps`` steps (bf16 kernels
    that sum in another order may part ways at a near tie, not before) and close logits until they part."""
    steps = min(len(ours.logits), len(theirs.logits))
    agree = next((step for step in range(steps)
                  if not torch.equal(ours.logits[step].argmax(-1), theirs.logits[step].argmax(-1))), steps)
    assert agree >= min_steps, agree
    assert relative_error(torch.stack(ours.logits[:agree]), torch.stack(theirs.logits[:agree])) <= 2e-2


@pytest.fixture
def registrations(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """A fresh process pool; the sizes of the blocks registered with CUDA and unregistered from now on."""
    from flexicache import host_memory

    events: dict[str, list[int]] = {"registered": [], "unregistered": []}
    register, release = host_memory._RegisteredMapping.register, host_memory._RegisteredMapping.__del__

    def recorded_register(self) -> None:
        register(self)
        events["registered"].append(len(self))

    def recorded_release(self) -> None:
        if self.address is not None:
            events["unregistered"].append(len(self))
        release(self)

    monkeypatch.setattr(host_memory._RegisteredMapping, "register", recorded_register)
    monkeypatch.setattr(host_memory._RegisteredMapping, "__del__", recorded_release)
    pool = host_pool.HostPool()
    monkeypatch.setattr(host_pool, "_process_pool", pool)
    yield events
    gc.collect()
    pool.release()


@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sequential_caches_reuse_the_pools_page_locked_blocks(registrations, cuda_graphs: bool) -> None:
    """Five requests with fresh caches, no garbage collection: the first registers the host tiers, the others reuse
    the same blocks (nothing registered again, nothing in use between requests), device memory stays flat, and
    every request generates the same tokens (the blocks' old contents never leak into a new cache)."""
    model = tiny_model()
    ids = torch.randint(0, 512, (8, 3000), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    pool = host_pool.host_pool()
    outputs, allocated, registered = [], [], []
    gc.collect()
    gc.disable()
    try:
        for _ in range(5):
            cache = FlexiCache.from_model(model, profile=PROFILE, token_budget=128, cuda_graphs=cuda_graphs)
            outputs.append(generate(model, cache, ids))
            assert cache.layers[3].storage.offloaded.host.k.is_pinned()
            assert cache.stats()["host_pool_in_use_bytes"] >= cache.stats()["host_reserved_bytes"] > 2**24
            del cache
            torch.cuda.synchronize()
            assert pool.in_use_bytes == 0, "a dropped cache's host tier was not given back"
            allocated.append(torch.cuda.memory_allocated())
            registered.append(len(registrations["registered"]))
    finally:
        gc.enable()
    assert registered[0] > 0 and registered[1:] == registered[:1] * 4, registered
    assert registrations["unregistered"] == []
    assert max(allocated[1:]) - min(allocated[1:]) <= 2**20, allocated
    assert all(torch.equal(output, outputs[0]) for output in outputs[1:])
    assert pool.release() == sum(registrations["registered"]) and sorted(registrations["unregistered"]) == sorted(
        registrations["registered"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_request_over_the_pool_limit_is_refused_before_registering(registrations) -> None:
    model = tiny_model()
    ids = torch.randint(0, 512, (8, 3000), device="cuda")
    host_pool.set_limit(0.02)  # the tiers need about 0.05 GiB
    cache = FlexiCache.from_model(model, profile=PROFILE, token_budget=128)
    with pytest.raises(HostMemoryError, match=r"GiB more host memory for the page-locked host tiers .*host pool's "
                                              r"limit of 0\.02 GiB.*Lower the batch size or the context"):
        generate(model, cache, ids)
    assert registrations["registered"] == [] and cache.get_seq_length() == 0
    host_pool.set_limit(None)
    assert generate(model, cache, ids).shape == (8, 3040)


def relative_error(result: torch.Tensor, reference: torch.Tensor) -> float:
    return float((result.double() - reference.double()).norm() / reference.double().norm())


def teacher_forced(model, cache, tokens: torch.Tensor) -> torch.Tensor:
    """``[T, B, V]`` logits of feeding ``tokens [B, T]`` one by one (keyword arguments: whole-step graphs replay
    these steps where the cache records them)."""
    logits = []
    with torch.inference_mode():
        for index in range(tokens.shape[1]):
            logits.append(model(input_ids=tokens[:, index:index + 1], past_key_values=cache).logits[:, -1].float())
    return torch.stack(logits)


def stored_state(cache: FlexiCache) -> list:
    """Every token, the min/max of the pages in use and the host tiers' full pages, per layer."""
    page_size, counts = cache.settings.page_size, cache.sequence.num_tokens_host
    pages = int(-(-counts.max() // page_size))
    state = [counts.clone()]
    for layer in cache.layers:
        storage = layer.storage
        state += [tensor.clone() for tensor in layer.read_logical()]
        state += [storage.meta.kmin[:, :, :pages].clone(), storage.meta.kmax[:, :, :pages].clone()]
        if storage.offloaded is not None:
            full = int((counts.min() - 1) // page_size)
            state += [storage.offloaded.host.k[:, :, :full].clone(), storage.offloaded.host.v[:, :, :full].clone()]
    return state


@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.gpu
@needs_fast_cuda_path
def test_a_crop_on_the_cuda_path_restores_the_state_before_the_cropped_tokens(cuda_graphs: bool) -> None:
    """Teacher-forced tokens, a snapshot, more tokens, a crop back to the snapshot: every stored token, page min/max
    and host-tier page equals the snapshot's; the same tokens fed again give the same logits (a covering budget:
    only the order of the pages in a row may differ) and take no new pool slots."""
    model = tiny_model()
    ids = torch.randint(0, 512, (4, 2000), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    more = torch.randint(0, 512, (4, 37), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    cache = FlexiCache.from_model(model, profile=PROFILE, token_budget=4096, cuda_graphs=cuda_graphs)
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache)
    teacher_forced(model, cache, more[:, :20])
    before = stored_state(cache)
    first = teacher_forced(model, cache, more[:, 20:])
    slots_used = [layer.storage.pool.used for layer in cache.layers]
    cache.crop(-17)
    after = stored_state(cache)
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    again = teacher_forced(model, cache, more[:, 20:])
    assert relative_error(again, first) <= 2e-2
    assert [layer.storage.pool.used for layer in cache.layers] == slots_used  # the cropped pages' slots reused
    assert (cache.stats()["step_graph_replays"] > 0) == cuda_graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_crop_select_and_repeat_stay_within_one_layers_memory() -> None:
    """The old dense rebuild read every layer's KV onto the device at once (the dense cache's size, and a transformed
    copy); now a crop allocates almost nothing, and a selection or repeat, beyond what the cache holds before or
    after it (whichever is more), at most one layer's storage (that layer's old one, while its new one is filled).
    Memory the operation frees for good (a split layer's FlashInfer plan, remade at the next step) is not transient."""
    model = tiny_model()
    ids = torch.randint(0, 512, (8, 16000), device="cuda")
    cache = FlexiCache.from_model(model, profile=PROFILE, token_budget=128)
    generate(model, cache, ids, new_tokens=20)
    dense = cache.stats()["dense_kv_bytes"]
    slack = 2**23  # index tensors and the allocator's rounding
    for name, operation in (("crop", lambda: cache.crop(-9)),
                            ("select", lambda: cache.batch_select_indices(torch.arange(7, -1, -1))),
                            ("repeat", lambda: cache.batch_repeat_interleave(2))):
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        operation()
        torch.cuda.synchronize()
        transient = torch.cuda.max_memory_allocated() - max(start, torch.cuda.memory_allocated())
        largest = max(layer.storage.pool.nbytes_reserved + layer.storage.meta.nbytes for layer in cache.layers)
        if name == "crop":
            assert torch.cuda.max_memory_allocated() - start <= slack, name
        assert transient <= largest + slack, (name, transient, largest)
        assert transient < dense / 2, (name, transient, dense)
    tokens = torch.randint(0, 512, (16, cache.get_seq_length() + 1), device="cuda")  # the last one is decoded next
    assert generate(model, cache, tokens, new_tokens=8).shape == (16, tokens.shape[1] + 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_assisted_generation_through_crops_on_the_cuda_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers crops the cache after rejected candidates: at a covering budget every verification forward
    attends densely over the KV read back exactly, so the tokens are DynamicCache's (a last step with no candidate
    left decodes one token sparsely: compared within bf16)."""
    model, assistant = tiny_model(), tiny_model(layers=1)
    ids = torch.randint(0, 512, (1, 1500), device="cuda")
    crops: list[int] = []
    cache = FlexiCache.from_model(model, profile=PROFILE, token_budget=4096)
    original = FlexiCache.crop  # patched on the class: a bound method kept on the cache would make a cycle

    def recording(self, tokens: int) -> None:
        crops.append(tokens)
        original(self, tokens)

    monkeypatch.setattr(FlexiCache, "crop", recording)
    ours, theirs = (with_logits(model, used, ids, 30, assistant_model=assistant)
                    for used in (cache, DynamicCache(config=model.config)))
    assert torch.equal(ours.sequences[:, :-1], theirs.sequences[:, :-1])
    assert_same_generation(ours, theirs, min_steps=len(theirs.logits) - 1)
    assert any(tokens < 0 for tokens in crops), crops


@pytest.mark.gpu
@needs_fast_cuda_path
def test_a_graphed_step_that_fails_is_refused_until_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model()
    ids = torch.randint(0, 512, (2, 1000), device="cuda")
    expected = with_logits(model, FlexiCache.from_model(model, profile=PROFILE, token_budget=128), ids)
    cache = FlexiCache.from_model(model, profile=PROFILE, token_budget=128)
    original, calls = GraphedDecode.record_step, {"count": 0}

    def failing(self, *args, **kwargs):
        calls["count"] += 1
        if calls["count"] == 3:  # the third layer of the first recorded step
            raise RuntimeError("injected failure while recording")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GraphedDecode, "record_step", failing)
    with pytest.raises(RuntimeError, match="injected failure"):
        generate(model, cache, ids)
    monkeypatch.setattr(GraphedDecode, "record_step", original)
    with pytest.raises(RuntimeError, match=r"graph failed.*cache\.reset\(\)"), torch.inference_mode():
        model(ids[:, -1:], past_key_values=cache)  # the next decode step
    cache.reset()
    assert_same_generation(with_logits(model, cache, ids), expected, min_steps=10)
    assert cache.stats()["step_graph_replays"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_threads_sharing_the_flashinfer_backend_are_refused_clearly() -> None:
    pytest.importorskip("flashinfer")
    model = tiny_model()
    ids = torch.randint(0, 512, (2, 1000), device="cuda")
    ours = FlexiCache.from_model(model, profile=PROFILE, token_budget=128, backend="flashinfer")
    expected = with_logits(model, ours, ids)
    errors: list[str] = []  # messages only: an exception's traceback would keep the worker's cache alive

    def other() -> None:
        try:
            generate(model, FlexiCache.from_model(model, profile=PROFILE, token_budget=128, backend="flashinfer"),
                     ids)
        except RuntimeError as error:
            errors.append(str(error))

    thread = threading.Thread(target=other, name="worker")
    thread.start()
    thread.join()
    assert errors and "one thread at a time" in errors[0] and "'MainThread'" in errors[0], errors
    ours.close()
    results: list = []
    thread = threading.Thread(target=lambda: results.append(with_logits(
        model, FlexiCache.from_model(model, profile=PROFILE, token_budget=128, backend="flashinfer"), ids)))
    thread.start()
    thread.join()
    assert results, "the worker's generation failed after the other cache was closed"
    assert_same_generation(results[0], expected, min_steps=10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_threads_on_their_own_backends_decode_at_once() -> None:
    """Caches on the torch reference backend (the fused Triton path, zero-copy transfers, no graphs) share nothing:
    two threads generate at the same time and get each its own generation (kernels compiled first, here)."""
    model = tiny_model()
    prompts = [torch.randint(0, 512, (2, 1000 + 300 * index), device="cuda") for index in range(2)]

    def run(ids):
        return with_logits(model, FlexiCache.from_model(model, profile=PROFILE, token_budget=128,
                                                        backend="reference"), ids)

    expected = [run(ids) for ids in prompts]
    results: list = [None, None]
    barrier = threading.Barrier(2)

    def work(index: int) -> None:
        barrier.wait()
        results[index] = run(prompts[index])

    threads = [threading.Thread(target=work, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(result is not None for result in results), "a thread's generation failed"
    for result, want in zip(results, expected):
        assert_same_generation(result, want, min_steps=10)
