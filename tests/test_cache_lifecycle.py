"""A cache's life: freed by reference counting alone once nobody refers to it, closed at once on request, and
the small traps around building one (profile names, a model left on the flexicache attention without a FlexiCache).

The CUDA paths' freeing (fused kernels, per-layer and whole-step graphs, the shared FlashInfer backend) is checked
on the CPU in test_triton_interpreted.py (``check_freeing``) and on the GPU in test_gpu_flashinfer.py.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import warnings
import weakref

import pytest
import torch
from conftest import greedy, left_pad, mixed_profile, random_prompt, tiny_config, tiny_model
from transformers import DynamicCache, LlamaConfig

from flexicache import FlexiCache, HeadProfile, attention, warn_once


def referrers(obj: object) -> list[str]:
    """What still refers to ``obj`` (types only): the hint a failing freeing check prints."""
    return [type(referrer).__name__ for referrer in gc.get_referrers(obj)]


def generate_and_drop(model, make_cache, work) -> tuple[list[weakref.ref], dict]:
    """Run ``work(model, cache)`` on ``make_cache()`` with the cycle collector off, drop the cache, and return weak
    references to the cache, its layers and their storage (all must be dead) and its last stats."""
    gc.collect()
    gc.disable()
    try:
        cache = make_cache()
        work(model, cache)
        stats = cache.stats()
        refs = [weakref.ref(cache)] + [weakref.ref(layer) for layer in cache.layers]
        refs += [weakref.ref(layer.storage) for layer in cache.layers if layer.storage is not None]
        del cache
        alive = [ref() for ref in refs if ref() is not None]
        assert not alive, f"{type(alive[0]).__name__} still referred to by {referrers(alive[0])}"
    finally:
        gc.enable()
    return refs, stats


def generate(model, cache) -> None:
    ids, mask = left_pad([random_prompt(30, seed=1), random_prompt(19, seed=2)])
    greedy(model, ids, cache, mask, max_new_tokens=12)


def generate_crop_and_continue(model, cache) -> None:
    ids, mask = left_pad([random_prompt(30, seed=1), random_prompt(19, seed=2)])
    out = greedy(model, ids, cache, mask, max_new_tokens=10)
    cache.crop(-4)
    more = torch.cat([out[:, :-4], out[:, -4:]], dim=1)
    greedy(model, more, cache, torch.cat([mask, torch.ones(2, more.shape[1] - mask.shape[1], dtype=mask.dtype)], 1),
           max_new_tokens=5)
    cache.batch_select_indices(torch.tensor([1]))


@pytest.mark.parametrize("work", [generate, generate_crop_and_continue], ids=["generate", "crop-select"])
@pytest.mark.parametrize("from_model", [True, False], ids=["from-model", "plain"])
def test_a_dropped_cache_is_freed_by_reference_counting(work, from_model: bool) -> None:
    config = tiny_config(num_layers=3)
    model = tiny_model(config)
    model.set_attn_implementation(attention.ATTENTION_NAME)
    profile = mixed_profile(config)
    settings = {"profile": profile, "token_budget": 16, "page_size": 4, "rerank_interval": 3}
    make = (lambda: FlexiCache.from_model(model, **settings)) if from_model else (
        lambda: FlexiCache(model.config, **settings))
    _, stats = generate_and_drop(model, make, work)
    assert stats["decode_steps"] > 0 and stats["reranks_stable"] > 0 and stats["promoted_pages"] > 0


def test_close_frees_the_buffers_now_and_a_closed_cache_refuses_use() -> None:
    config = tiny_config(num_layers=2)
    model = tiny_model(config)
    ids = random_prompt(25, seed=3).view(1, -1)
    with FlexiCache.from_model(model, profile=mixed_profile(config), token_budget=16, page_size=4) as cache:
        greedy(model, ids, cache, max_new_tokens=6)
        storage = weakref.ref(cache.layers[1].storage)
        assert cache.stats()["decode_steps"] == 5
    gc.disable()  # the buffers go by reference counting, while the cache itself is still referred to
    try:
        assert storage() is None and all(layer.storage is None for layer in cache.layers)
    finally:
        gc.enable()
    with pytest.raises(RuntimeError, match="closed.*build a new FlexiCache"):
        greedy(model, ids, cache, max_new_tokens=2)
    with pytest.raises(RuntimeError, match="closed"):
        cache.stats()
    fresh = FlexiCache.from_model(model, token_budget=64, page_size=4)  # a new cache works (covering budget)
    assert torch.equal(greedy(model, ids, fresh, max_new_tokens=4),
                       greedy(model, ids, DynamicCache(config=model.config), max_new_tokens=4))


def smollm2_shaped_config() -> LlamaConfig:
    """A tiny config with the layer count, KV heads and head dim of SmolLM2-135M (the shipped profile's model)."""
    shipped = HeadProfile.from_pretrained("smollm2-135m-instruct")
    return LlamaConfig(vocab_size=64, hidden_size=3 * shipped.head_dim * 3, intermediate_size=32,
                       num_hidden_layers=shipped.num_layers, num_attention_heads=3 * shipped.num_kv_heads,
                       num_key_value_heads=shipped.num_kv_heads, head_dim=shipped.head_dim)


def test_profile_names_resolve_like_from_pretrained(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shipped profile's name, a file, a folder and a hub id (downloaded through huggingface_hub) all work as
    ``profile=``, exactly as :meth:`HeadProfile.from_pretrained` reads them."""
    config = smollm2_shaped_config()
    shipped = HeadProfile.from_pretrained("smollm2-135m-instruct")
    assert FlexiCache(config, profile="smollm2-135m-instruct").profile.unstable_heads == shipped.unstable_heads
    shipped.save(tmp_path / "flexicache_profile.json")
    assert FlexiCache(config, profile=tmp_path).profile.unstable_heads == shipped.unstable_heads
    downloads = []

    def download(repo_id: str, filename: str, revision=None) -> str:
        downloads.append((repo_id, filename))
        return str(tmp_path / filename)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert FlexiCache(config, profile="someone/profiled-model").profile.unstable_heads == shipped.unstable_heads
    assert downloads == [("someone/profiled-model", "flexicache_profile.json")]
    with pytest.raises(ValueError, match="made for a model with 30 layers"):
        FlexiCache(tiny_config(num_layers=2), profile="smollm2-135m-instruct")


def test_the_flexicache_attention_without_a_flexicache_warns_once_that_decoding_is_dense(monkeypatch) -> None:
    """A model on the flexicache attention that generates with another cache (or none) decodes densely: it says so,
    once, with what to pass; a prefill alone (one forward, no decode step) does not warn."""
    monkeypatch.setattr(warn_once, "GIVEN", set())
    config = tiny_config(num_layers=2)
    model = tiny_model(config)
    model.set_attn_implementation(attention.ATTENTION_NAME)
    ids = random_prompt(12, seed=4).view(1, -1)

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model(ids)  # no decode step
        greedy(model, ids, FlexiCache(config, token_budget=16, page_size=4), max_new_tokens=3)  # sparse: silent
    with pytest.warns(UserWarning, match="no FlexiCache was passed.*past_key_values=FlexiCache.from_model"):
        greedy(model, ids, DynamicCache(config=config), max_new_tokens=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        greedy(model, ids, DynamicCache(config=config), max_new_tokens=3)  # once per process


GRAD_MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "plain": contextlib.nullcontext}


def decode_in_modes(model, cache, ids: torch.Tensor, modes: list[str], steps: int) -> list[int]:
    """Prefill ``ids`` under ``modes[0]``, then ``steps`` greedy decode steps, step ``i`` under
    ``modes[(i + 1) % len(modes)]``, the one a quarter in extending the cache by ``ids``' first 10 tokens (a chunk
    of several tokens after decode steps), with a crop of the last 3 positions halfway; the tokens."""
    with GRAD_MODES[modes[0]]():
        logits = model(ids, past_key_values=cache).logits
    tokens = [int(logits[0, -1].argmax())]
    for step in range(steps):
        with GRAD_MODES[modes[(step + 1) % len(modes)]]():
            if step == steps // 2:
                cache.crop(-3)
                tokens = tokens[:-3]
            step_ids = ids[:, :10] if step == steps // 4 else torch.tensor([[tokens[-1]]])
            logits = model(step_ids, past_key_values=cache).logits
        tokens.append(int(logits[0, -1].argmax()))
    return tokens


@pytest.mark.parametrize("modes", [["inference_mode", "no_grad", "plain"], ["plain", "inference_mode", "no_grad"],
                                   ["no_grad", "plain", "inference_mode"]], ids="-then-".join)
def test_any_grad_mode_in_any_order(modes: list[str]) -> None:
    """A cache filled under one grad mode decodes under the others, step after step and through a crop, with the
    tokens of a run in inference mode alone; its buffers never join an autograd graph and are never inference
    tensors (which would refuse the next in-place write outside inference mode)."""
    config = tiny_config(num_layers=3)
    model = tiny_model(config)
    ids = random_prompt(30, seed=5).view(1, -1)
    settings = {"profile": mixed_profile(config), "token_budget": 16, "page_size": 4, "rerank_interval": 3}
    expected = decode_in_modes(model, FlexiCache.from_model(model, **settings), ids, ["inference_mode"], 14)
    cache = FlexiCache.from_model(model, **settings)
    assert decode_in_modes(model, cache, ids, modes, 14) == expected
    storage = [layer.storage for layer in cache.layers]
    buffers = [tensor for stored in storage for tensor in (stored.pool.k, stored.meta.kmin, stored.write_slots)]
    buffers += [stored.offloaded.host.k for stored in storage if stored.offloaded is not None]
    assert not any(tensor.requires_grad or tensor.is_inference() for tensor in buffers)
    assert cache.stats()["promoted_pages"] > 0


@pytest.mark.parametrize("copy_mode", ["inference_mode", "no_grad"])
def test_a_deep_copy_of_a_prompt_cache_continues_in_any_grad_mode(copy_mode: str) -> None:
    """The prompt-reuse recipe: prefill once, deep-copy the cache per continuation. The copy continues as the
    original does, whatever grad mode copied it (its buffers are never inference tensors), and the original is
    untouched by the copy's decoding."""
    config = tiny_config(num_layers=3)
    model = tiny_model(config)
    prompt = random_prompt(30, seed=1).view(1, -1)
    question = torch.cat([prompt, random_prompt(5, seed=2).view(1, -1)], 1)
    cache = FlexiCache.from_model(model, profile=mixed_profile(config), token_budget=16, page_size=4,
                                  rerank_interval=3)
    with torch.no_grad():
        model(prompt, past_key_values=cache)
    with GRAD_MODES[copy_mode]():
        copied = copy.deepcopy(cache)
    assert not any(tensor.is_inference() for layer in copied.layers
                   for tensor in (layer.storage.pool.k, layer.storage.meta.kmin))
    continued = model.generate(question, past_key_values=copied, max_new_tokens=6, do_sample=False)
    assert cache.get_seq_length() == 30
    assert torch.equal(continued, model.generate(question, past_key_values=cache, max_new_tokens=6, do_sample=False))


def test_a_new_batch_on_a_used_cache_is_refused_and_leaves_nothing_for_the_next_forward() -> None:
    """Another batch size without ``reset()`` gets the clear error before any layer stages its chunk, so the
    model's next forward, with any cache, runs as if the refused one never happened; a cache built for fewer layers
    than the model says so."""
    config = tiny_config(num_layers=3)
    model = tiny_model(config)
    ids = random_prompt(20, seed=1).view(1, -1)
    cache = FlexiCache.from_model(model, token_budget=64, profile="default")
    greedy(model, ids, cache, max_new_tokens=4)
    with pytest.raises(ValueError, match="holds a batch of 1 requests, got 3: call cache.reset"):
        greedy(model, random_prompt(30, seed=2).view(1, -1).repeat(3, 1), cache, max_new_tokens=4)
    dense = greedy(model, ids, DynamicCache(config=model.config), max_new_tokens=4)
    assert torch.equal(greedy(model, ids, FlexiCache.from_model(model, token_budget=64), max_new_tokens=4), dense)
    short = FlexiCache(tiny_config(num_layers=2), token_budget=64)
    with pytest.raises(ValueError, match="built for a model of 2 decoder layers and got layer 2"):
        greedy(model, ids, short, max_new_tokens=2)


def test_a_decode_step_that_would_carry_gradients_says_once_that_it_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(warn_once, "GIVEN", set())
    config = tiny_config(num_layers=2)
    model = tiny_model(config)
    cache = FlexiCache.from_model(model, token_budget=16, page_size=4)
    ids = random_prompt(20, seed=4).view(1, -1)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*not differentiable")  # the prompt's dense attention carries gradients
        model(ids, past_key_values=cache)
        with torch.no_grad():
            model(ids[:, :1], past_key_values=cache)
    with pytest.warns(UserWarning, match="sparse decode attention is not differentiable"):
        model(ids[:, 1:2], past_key_values=cache)
