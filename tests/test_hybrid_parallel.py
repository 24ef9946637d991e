"""Hybrid models (full-attention and sliding-window layers) under accelerate's hooks and tensor parallelism: every
layer's KV, windows included, stays on its layer's device, and each tensor-parallel rank holds its KV heads of both
layer types."""

from __future__ import annotations

import accelerate
import pytest
import torch
from conftest import checked, greedy, left_pad, random_prompt
from hybrid_models import COMMON, family_model
from test_parallel import run_tensor_parallel_ranks, tensor_parallel_unavailable
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from flexicache import FlexiCache, FlexiLayer, HeadProfile
from flexicache.parallel import BYTE_KEYS, kv_bytes_by_device
from flexicache.sliding import SlidingWindowLayer


def test_cpu_offloaded_hybrid_model_matches_dynamic_cache():
    """accelerate.cpu_offload (weights streamed in by hooks): the same tokens as DynamicCache at a covering budget,
    the windows on the layers' execution device and counted there."""
    ids, mask = left_pad([random_prompt(41, seed=1), random_prompt(27, seed=2)])
    model = accelerate.cpu_offload(family_model("gemma3", seed=4), execution_device="cpu")
    reference = greedy(model, ids, DynamicCache(config=model.config), mask, 16)
    cache = checked(FlexiCache.from_model(model, token_budget=64, page_size=8))
    assert torch.equal(greedy(model, ids, cache, mask, 16), reference)
    assert {str(layer.device) for layer in cache.layers} == {"cpu"}
    assert kv_bytes_by_device(cache) == {"cpu": {key: cache.stats()[key] for key in BYTE_KEYS}}
    assert cache.stats()["sliding_kv_bytes"] > 0


@pytest.mark.skipif(tensor_parallel_unavailable() is not None, reason=str(tensor_parallel_unavailable()))
def test_tensor_parallel_hybrid_generation_on_two_cpu_ranks(tmp_path):
    """Qwen2 with sliding layers (layers 0-1 full attention, 2-3 sliding), tp_plan="auto" over 2 gloo ranks: every
    rank holds 2 of the 4 KV heads in both layer types; at a covering budget the tokens are DynamicCache's, at a small
    one those of a single-process FlexiCache with the full profile."""
    config = Qwen2Config(**{**COMMON, "hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 4,
                            "vocab_size": 128}, num_hidden_layers=4, use_sliding_window=True, sliding_window=16,
                         max_window_layers=2)
    torch.manual_seed(3)
    model = Qwen2ForCausalLM(config).eval().to(torch.float64)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    ids, mask = left_pad([random_prompt(70, 1, vocab_size=128), random_prompt(55, 2, vocab_size=128)])
    profile = HeadProfile(4, 4, 8, [(0, 0), (0, 1), (0, 2), (0, 3), (1, 2)], sparse_layers=[0, 1])
    ranks = run_tensor_parallel_ranks(tmp_path, model, ids, mask, profile, gpus=False, dtype="float64")
    single = FlexiCache.from_model(model, profile=profile, token_budget=32, page_size=8, rerank_interval=4)
    single_tokens = greedy(model, ids, single, mask, 24).tolist()
    assert [type(layer) for layer in single.layers] == [FlexiLayer, FlexiLayer, SlidingWindowLayer,
                                                        SlidingWindowLayer]
    for rank, result in enumerate(ranks):
        assert result["shard"] == [rank, 2]
        full, small = result["full_budget"], result["small_budget"]
        for run in (full, small, result["small_budget_from_model"]):
            assert run["kv_heads"] == run["stored_kv_heads"] == [2, 2] and run["window_kv_heads"] == [2, 2]
            assert run["unstable_heads"] == [[0, 1], [] if rank == 0 else [0]]
            assert set(run["bytes_by_device"]) == {"cpu"}
        assert full["tokens"] == result["dense"] == ranks[0]["dense"] and full["max_logit_difference"] <= 1e-10
        assert small["tokens"] == result["small_budget_from_model"]["tokens"] == single_tokens
        assert small["bytes_by_device"]["cpu"]["device_kv_bytes"] < full["bytes_by_device"]["cpu"]["device_kv_bytes"]
        assert 2 * small["dense_kv_bytes"] == single.stats()["dense_kv_bytes"]  # each rank holds half of the heads
