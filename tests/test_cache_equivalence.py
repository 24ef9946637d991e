"""token_budget >= context: FlexiCache generates exactly what DynamicCache generates (greedy, fp64 logits ~1e-10)."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    assert_same_generation,
    dense_cache,
    greedy,
    left_pad,
    mixed_profile,
    random_prompt,
    tiny_config,
    tiny_model,
)

from flexicache import FlexiCache


@pytest.mark.parametrize("group", [1, 2, 4, 7])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_budget_covering_context_matches_dynamic_cache(family, group):
    config = tiny_config(family, group=group, num_kv_heads=2, num_layers=3)
    model = tiny_model(config, seed=group)
    prompt = random_prompt(37, seed=group)
    ids = prompt.view(1, -1)
    # 37 + 30 tokens = 67 <= 72 = 9 pages of 8: the last pages are exactly the budget.
    cache = assert_same_generation(model, ids, torch.ones_like(ids), 30, profile=mixed_profile(config),
                                   token_budget=72, page_size=8, rerank_interval=4)
    stats = cache.stats()
    assert stats["reranks_stable"] > 0 and stats["reranks_unstable"] > 0


@pytest.mark.parametrize("prompt_length,new_tokens,page_size,budget", [
    (5, 25, 16, 32),  # K = 2: the sink page fills during decode
    (16, 17, 16, 48),  # the prompt ends exactly on a page boundary
    (1, 20, 4, 24),  # one-token prompt
    (40, 9, 8, 48),  # the context reaches exactly K full pages
])
def test_page_boundaries_match_dynamic_cache(prompt_length, new_tokens, page_size, budget):
    config = tiny_config("llama", group=2, num_kv_heads=2, num_layers=3)
    model = tiny_model(config, seed=prompt_length)
    ids = random_prompt(prompt_length, seed=prompt_length).view(1, -1)
    assert_same_generation(model, ids, torch.ones_like(ids), new_tokens, profile=mixed_profile(config),
                           token_budget=budget, page_size=page_size, rerank_interval=16)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_left_padded_batch_budget_covering_context_matches_dynamic_cache(family):
    config = tiny_config(family, group=2, num_kv_heads=2, num_layers=3)
    model = tiny_model(config, seed=7)
    ids, mask = left_pad([random_prompt(n, seed=n) for n in (33, 12, 50)])
    assert_same_generation(model, ids, mask, 20, profile=mixed_profile(config), token_budget=80, page_size=16,
                           rerank_interval=3)


def test_default_profile_and_all_stable_or_all_unstable():
    config = tiny_config("mistral", group=2, num_kv_heads=2, num_layers=3)
    model = tiny_model(config, seed=3)
    ids = random_prompt(30, seed=3).view(1, -1)
    for profile in (None, mixed_profile(config, unstable=[]),
                    mixed_profile(config, unstable=[(l, h) for l in range(3) for h in range(2)])):
        assert_same_generation(model, ids, torch.ones_like(ids), 12, profile=profile, token_budget=64, page_size=8)


def test_float32_budget_covering_context_matches_dynamic_cache():
    config = tiny_config("llama", group=4, num_kv_heads=2, num_layers=3)
    model = tiny_model(config, seed=1, dtype=torch.float32)
    ids = random_prompt(45, seed=1).view(1, -1)
    assert_same_generation(model, ids, torch.ones_like(ids), 16, atol=1e-4, profile=mixed_profile(config),
                           token_budget=64, page_size=16)


def test_new_generate_spelling_cache_keyword():
    """transformers >= 5.24 names the argument ``cache=``; the FlexiCache works under both spellings."""
    config = tiny_config("llama", group=2, num_kv_heads=2, num_layers=2)
    model = tiny_model(config, seed=8)
    ids = random_prompt(25, seed=8).view(1, -1)

    def generate(cache) -> torch.Tensor:
        return model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=8, do_sample=False)

    try:  # asked of a DynamicCache, so that an error of FlexiCache's below fails the test
        expected = generate(dense_cache(model))
    except (TypeError, ValueError) as error:  # transformers 5.17 only knows past_key_values=
        pytest.skip(f"this transformers has no generate(cache=): {error}")
    cache = FlexiCache.from_model(model, token_budget=64, page_size=8)
    out = generate(cache)
    assert cache.stats()["decode_steps"] == 7
    assert torch.equal(out, expected) and torch.equal(out, greedy(model, ids, dense_cache(model), None, 8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_and_stores_in_model_dtype(dtype):
    config = tiny_config("llama", group=2, num_kv_heads=2, num_layers=3)
    model = tiny_model(config, seed=0, dtype=dtype)
    ids = random_prompt(60, seed=0).view(1, -1)
    cache = FlexiCache.from_model(model, profile=mixed_profile(config), token_budget=32, page_size=8)
    out, logits = greedy(model, ids, cache, None, 10, logits=True)
    assert out.shape == (1, 70) and all(bool(torch.isfinite(step).all()) for step in logits)
    keys, _ = cache.layers[1].read_logical()
    assert keys.dtype == dtype and cache.layers[1].storage.pool.k.dtype == dtype


def test_chunked_prefill_matches_one_prefill():
    """``generate(prefill_chunk_size=...)`` (transformers' chunked prefill: the prompt in multi-token chunks on a
    non-empty cache, through left padding) gives the tokens of one prefill: DynamicCache's when the budget covers
    the context, the unchunked FlexiCache's at a small budget (8-token pages, 3 per head). At the small budget the
    boxes are in the model's axes: principal axes come from the first chunk, 16 tokens here against the whole prompt
    unchunked, so the selections may differ (each is exact attention over its own pages)."""
    config = tiny_config(group=2, num_kv_heads=2, num_layers=3)
    model = tiny_model(config, seed=1)
    ids, mask = left_pad([random_prompt(70, seed=1), random_prompt(55, seed=2)])

    def generate(cache, **options) -> torch.Tensor:
        return model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12, do_sample=False,
                              **options)

    try:  # asked of a DynamicCache, so that an error of FlexiCache's below fails the test
        generate(dense_cache(model), prefill_chunk_size=16)
    except (TypeError, ValueError) as error:  # a transformers without chunked prefill in generate
        pytest.skip(f"this transformers has no generate(prefill_chunk_size=): {error}")
    for budget, reference in ((128, generate(dense_cache(model))), (24, None)):
        settings = {"profile": mixed_profile(config), "token_budget": budget, "page_size": 8,
                    "principal_bounds": reference is not None}
        if reference is None:
            reference = generate(FlexiCache.from_model(model, **settings))
        cache = FlexiCache.from_model(model, **settings)
        chunked = generate(cache, prefill_chunk_size=16)
        prefill_chunks = -(-ids.shape[1] // 16)
        assert all(layer.num_chunks == prefill_chunks + cache.stats()["decode_steps"] for layer in cache.layers)
        assert torch.equal(chunked, reference), budget
