"""Device/host byte accounting follows the DESIGN formula; dense_kv_bytes is what a DynamicCache really holds."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    cdiv,
    dense_cache,
    dynamic_cache_bytes,
    greedy,
    left_pad,
    mixed_profile,
    random_prompt,
    tiny_config,
    tiny_model,
)

from flexicache import FlexiCache
from flexicache.cache import COUNTED_STATS


def expected_bytes(config, profile, real_tokens: list[int], page_size: int, budget: int, element: int):
    """``(device_kv_bytes, host_kv_bytes)`` from the DESIGN: unstable heads' pages in use + stable heads' K + C slots
    on the device (C = K standby pages, the default), stable heads' pages on the host."""
    page_bytes = 2 * page_size * config.head_dim * element
    used_pages = sum(cdiv(n, page_size) for n in real_tokens)
    k = 2 * (budget // page_size)
    device = host = 0
    for layer in range(config.num_hidden_layers):
        unstable = len(profile.unstable_heads_of(layer))
        stable = config.num_key_value_heads - unstable
        device += unstable * used_pages * page_bytes + stable * len(real_tokens) * k * page_bytes
        host += stable * used_pages * page_bytes
    return device, host


@pytest.mark.parametrize("dtype,lengths,budget,page_size,new_tokens", [
    (torch.float32, (90, 41, 130), 32, 8, 12),
    (torch.float64, (70,), 64, 16, 1),  # prefill only
    (torch.float32, (20, 5), 64, 16, 30),  # budget above the context
])
def test_byte_accounting_matches_design_formula(dtype, lengths, budget, page_size, new_tokens):
    config = tiny_config("llama", group=2, num_kv_heads=3, num_layers=3)
    model = tiny_model(config, seed=1, dtype=dtype)
    profile = mixed_profile(config)
    ids, mask = left_pad([random_prompt(n, seed=n) for n in lengths])
    cache = FlexiCache.from_model(model, profile=profile, token_budget=budget, page_size=page_size,
                                  rerank_interval=4)
    greedy(model, ids, cache, mask, new_tokens)
    reference = dense_cache(model)
    greedy(model, ids, reference, mask, new_tokens)
    stats = cache.stats()
    element = torch.empty(0, dtype=dtype).element_size()
    real_tokens = [n + new_tokens - 1 for n in lengths]  # generate never feeds back its last token
    device, host = expected_bytes(config, profile, real_tokens, page_size, budget, element)
    assert stats["device_kv_bytes"] == device
    assert stats["host_kv_bytes"] == host
    assert stats["dense_kv_bytes"] == dynamic_cache_bytes(reference)
    # the tensors really are that size
    page_bytes = 2 * page_size * config.head_dim * element
    pool_used = sum(layer.storage.pool.used for layer in cache.layers) * page_bytes
    assert pool_used == device
    assert stats["device_reserved_bytes"] >= device + stats["device_metadata_bytes"]
    # the principal axes: one [D, D] matrix per request and head (float32, float64 for float64 keys)
    axes = config.num_hidden_layers * len(lengths) * config.num_key_value_heads * config.head_dim ** 2 * max(element, 4)
    assert all(layer.storage.basis.matrix.shape == (len(lengths), 3, config.head_dim, config.head_dim)
               for layer in cache.layers)
    assert stats["device_reserved_bytes"] == sum(layer.storage.pool.nbytes_reserved + layer.storage.meta.nbytes
                                                 for layer in cache.layers) + axes
    used_pages = sum(cdiv(n, page_size) for n in real_tokens)  # min and max of every page in use, every head
    assert stats["device_metadata_bytes"] == 2 * used_pages * config.num_key_value_heads * \
        config.num_hidden_layers * config.head_dim * element + axes
    assert stats["host_reserved_bytes"] >= host
    # counters
    num_unstable = len(profile.unstable_heads)
    assert stats["decode_steps"] == new_tokens - 1
    assert stats["reranks_unstable"] == (new_tokens - 1) * len(lengths) * num_unstable
    assert stats["bytes_h2d"] >= stats["promoted_pages"] * page_bytes
    assert stats["token_budget"] == budget and stats["unstable_heads"] == num_unstable


def test_long_context_device_bytes_below_dense():
    config = tiny_config("llama", group=2, num_kv_heads=4, num_layers=4)
    model = tiny_model(config, seed=2, dtype=torch.float32)
    ids = random_prompt(400, seed=9).view(1, -1)
    cache = FlexiCache.from_model(model, profile="default", token_budget=32, page_size=16)  # 2 layers unstable
    greedy(model, ids, cache, None, 2)
    stats = cache.stats()
    # half the layers keep everything, the other half 2 pages of 26: ~54% of dense
    assert 0.5 * stats["dense_kv_bytes"] < stats["device_kv_bytes"] < 0.6 * stats["dense_kv_bytes"]
    assert stats["host_kv_bytes"] >= 0.49 * stats["dense_kv_bytes"]


def test_stats_before_use_and_after_reset():
    config = tiny_config("llama", group=2, num_kv_heads=2, num_layers=2)
    model = tiny_model(config, dtype=torch.float32)
    cache = FlexiCache.from_model(model, token_budget=32, page_size=16)
    stats = cache.stats()  # every documented key, before the first forward as after a reset
    assert stats["decode_steps"] == 0 and stats["backend"] is None and all(stats[name] == 0 for name in COUNTED_STATS)
    greedy(model, random_prompt(20, seed=0).view(1, -1), cache, None, 3)
    assert cache.stats()["device_kv_bytes"] > 0
    cache.reset()
    stats = cache.stats()
    assert stats["decode_steps"] == 0 and cache.get_seq_length() == 0 and stats["device_kv_bytes"] == 0
    assert set(COUNTED_STATS) <= set(stats)


def test_work_counters_survive_crop_and_reorder():
    """Counters are cumulative: crop / batch reordering re-pages the cache but must not erase the work done."""
    config = tiny_config("llama", group=2, num_kv_heads=2, num_layers=3)
    model = tiny_model(config, seed=1)
    ids, mask = left_pad([random_prompt(60, seed=1), random_prompt(41, seed=2)])
    cache = FlexiCache.from_model(model, profile=mixed_profile(config), token_budget=16, page_size=4,
                                  rerank_interval=2)
    greedy(model, ids, cache, mask, 10)
    names = ("reranks_unstable", "reranks_stable", "promoted_pages", "bytes_h2d", "bytes_d2h", "decode_steps")
    before = cache.stats()
    assert all(before[name] > 0 for name in names)
    cache.crop(-2)
    cache.batch_select_indices(torch.tensor([1, 0]))
    after = cache.stats()
    for name in names:
        assert after[name] >= before[name], name
    assert after["decode_steps"] == before["decode_steps"]
    cache.reset()
    assert all(cache.stats().get(name, 0) == 0 for name in names)
