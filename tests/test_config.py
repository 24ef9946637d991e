"""Bad input fails at once with a message that says what to change."""

from __future__ import annotations

import pytest
import torch
from conftest import Driver, FakeAttention, greedy, random_prompt, tiny_config, tiny_model
from transformers import DynamicCache, Gemma2Config, Gemma2ForCausalLM

from flexicache import FlexiCache, FlexiCacheConfig, HeadProfile
from flexicache.attention import ATTENTION_NAME, flexicache_attention_forward, real_tokens_of_chunk


@pytest.mark.parametrize("page_size", [3, 12, 0, -4, 24])
def test_page_size_must_be_power_of_two(page_size):
    with pytest.raises(ValueError, match="power of two"):
        FlexiCacheConfig(token_budget=96, page_size=page_size)
    with pytest.raises(ValueError, match="power of two"):
        FlexiCache(tiny_config(), token_budget=96, page_size=page_size)


@pytest.mark.parametrize("budget,page_size", [(16, 16), (8, 16), (0, 4), (31, 16)])
def test_budget_below_sink_plus_tail(budget, page_size):
    with pytest.raises(ValueError, match="sink page plus the tail page"):
        FlexiCache(tiny_config(), token_budget=budget, page_size=page_size)


def test_budget_not_multiple_of_page_size_suggests_neighbours():
    with pytest.raises(ValueError, match="not a multiple of page_size=16; use 32 or 48"):
        FlexiCache(tiny_config(), token_budget=40, page_size=16)


def test_valid_settings_and_other_fields():
    settings = FlexiCacheConfig(token_budget=64, page_size=16)
    assert settings.pages_per_head == 4
    FlexiCacheConfig(token_budget=2, page_size=1)  # the smallest valid budget
    with pytest.raises(ValueError, match="rerank_interval"):
        FlexiCacheConfig(rerank_interval=0)
    with pytest.raises(ValueError, match="group_reduce"):
        FlexiCacheConfig(group_reduce="mean")
    with pytest.raises(ValueError, match="backend"):
        FlexiCacheConfig(backend="cuda")
    assert FlexiCacheConfig(page_size=16, max_cache_len=33).reserved_pages == 3
    assert FlexiCacheConfig().reserved_pages == 0
    assert FlexiCacheConfig(max_cache_len=torch.tensor(100)).max_cache_len == 100  # numpy/torch integers
    assert type(FlexiCacheConfig(max_cache_len=torch.tensor(100)).max_cache_len) is int
    for wrong in (0, -5, 2.5, "1024", True, torch.tensor(1.5)):
        with pytest.raises(ValueError, match="max_cache_len must be a positive number of tokens"):
            FlexiCacheConfig(max_cache_len=wrong)


def test_unstable_fraction_is_a_share_of_the_online_split():
    assert FlexiCacheConfig(unstable_fraction=1).unstable_fraction == 1.0
    for wrong in (0, 0.0, -0.25, 1.5, float("nan"), True, "half", None):
        with pytest.raises(ValueError, match=r"unstable_fraction must be a number in \(0, 1\]"):
            FlexiCacheConfig(unstable_fraction=wrong)
    profile = HeadProfile.default(tiny_config())
    for fixed in (profile, "default"):  # a profile lists its heads: a share for the online split is refused
        with pytest.raises(ValueError, match=r"unstable_fraction=0.5 sets the share of the online head split.*"
                                             r"profile=None.*flexicache profile --fraction"):
            FlexiCache(tiny_config(), profile=fixed, token_budget=32, unstable_fraction=0.5)
    FlexiCache(tiny_config(), profile=profile, token_budget=32)  # the default share with a profile is no conflict


def test_flashinfer_backend_on_cpu_is_refused():
    from flexicache.backends.flashinfer import flashinfer_available

    config = tiny_config(num_layers=1)
    model = tiny_model(config)
    if not flashinfer_available():  # refused at construction, before the model is touched
        with pytest.raises(ImportError, match=r"flexicache-kv\[cuda\]"):
            FlexiCache.from_model(model, token_budget=32, page_size=8, backend="flashinfer")
        assert model.config._attn_implementation != "flexicache"
        return
    cache = FlexiCache.from_model(model, token_budget=32, page_size=8, backend="flashinfer")
    with pytest.raises(ValueError, match="CUDA"):
        greedy(model, random_prompt(5, seed=0).view(1, -1), cache, None, 2)


@pytest.mark.parametrize(("dtype", "head_dim", "reason"), [
    (torch.float32, 128, "float16/bfloat16 KV, this KV is torch.float32"),
    (torch.float64, 64, "float16/bfloat16 KV, this KV is torch.float64"),
    (torch.bfloat16, 16, "head dims .*this model's is 16"),
])
def test_kv_flashinfer_cannot_decode_gets_the_reference_backend(dtype, head_dim, reason):
    """On CUDA, "auto" falls back to the torch kernel (with a warning) for KV FlashInfer has no kernel for, and an
    explicit "flashinfer" is refused with what to change (nothing here touches a GPU: the check comes first)."""
    from flexicache.backends import ReferenceBackend, resolve_backend

    cuda = torch.device("cuda", 0)
    with pytest.warns(UserWarning, match=reason):
        assert isinstance(resolve_backend("auto", cuda, dtype, head_dim), ReferenceBackend)
    with pytest.raises(ValueError, match=f"backend='flashinfer': FlashInfer decodes {reason}.*'auto' or 'reference'"):
        resolve_backend("flashinfer", cuda, dtype, head_dim)


def test_a_layer_flashinfer_cannot_decode_gets_its_own_fallback():
    """Layers share their device's backend; a later layer whose KV the shared FlashInfer backend cannot decode gets
    the torch kernel (warned) or, with backend="flashinfer", an error, and the shared entry stays."""
    from flexicache.backends import ReferenceBackend, layer_backend

    cuda = torch.device("cuda", 0)
    shared = object()  # stands for the FlashInfer backend that the device's first (bf16, head dim 128) layer got
    backends = {cuda: shared}
    assert layer_backend(backends, "auto", cuda, torch.bfloat16, 128) is shared
    with pytest.warns(UserWarning, match="this KV is torch.float32"):
        assert isinstance(layer_backend(backends, "auto", cuda, torch.float32, 128), ReferenceBackend)
    with pytest.raises(ValueError, match="backend='flashinfer': .*this model's is 96"):
        layer_backend(backends, "flashinfer", cuda, torch.bfloat16, 96)
    assert backends == {cuda: shared}


def test_flashinfer_backend_refuses_a_head_dim_it_has_no_kernel_for(monkeypatch):
    """Known from the config, so refused at construction rather than inside the first generate."""
    from flexicache.backends import flashinfer

    monkeypatch.setattr(flashinfer, "flashinfer_available", lambda: True)
    with pytest.raises(ValueError, match=r"head dims \(64, 128, 256\), this model's is 8.*'auto' or 'reference'"):
        FlexiCache(tiny_config(num_layers=1, head_dim=8), token_budget=32, page_size=8, backend="flashinfer")


@pytest.mark.parametrize("shape", [(4, 2, 8), (3, 4, 8), (3, 2, 16)])
def test_profile_for_another_model(shape):
    config = tiny_config(num_layers=3, num_kv_heads=2, head_dim=8)
    profile = HeadProfile(*shape, unstable_heads=[(0, 0)], model="other/model")
    with pytest.raises(ValueError, match="made for a model with .*other/model.*profile=None"):
        FlexiCache(config, profile=profile, token_budget=32, page_size=8)


def test_profile_path_and_head_range(tmp_path):
    config = tiny_config(num_layers=3, num_kv_heads=2, head_dim=8)
    profile = HeadProfile(3, 2, 8, unstable_heads=[(2, 1), (0, 0), (0, 0)])
    assert profile.unstable_heads == [(0, 0), (2, 1)]
    path = tmp_path / "profile.json"
    profile.save(path)
    cache = FlexiCache(config, profile=str(path), token_budget=32, page_size=8)
    assert cache.profile.unstable_heads == [(0, 0), (2, 1)]
    assert [layer.unstable_heads for layer in cache.layers] == [[0], [], [1]]
    assert [layer.stable_heads for layer in cache.layers] == [[1], [0, 1], [0]]
    with pytest.raises(ValueError, match="outside the profiled shape"):
        HeadProfile(3, 2, 8, unstable_heads=[(3, 0)])


def test_beam_search_is_refused():
    config = tiny_config(num_layers=2)
    model = tiny_model(config)
    cache = FlexiCache.from_model(model, token_budget=32, page_size=8)
    with pytest.raises(NotImplementedError, match="beam search"):
        model.generate(random_prompt(10, seed=0).view(1, -1), past_key_values=cache, num_beams=2, max_new_tokens=4,
                       do_sample=False)


def test_refused_model_is_not_switched():
    """A model FlexiCache refuses (here Gemma 2 with its attention logit softcap) keeps its attention."""
    config = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = Gemma2ForCausalLM(config)
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        FlexiCache.from_model(model, token_budget=32, page_size=8)
    assert model.config._attn_implementation == before, "a refused model must not be switched"


def test_model_not_switched_to_flexicache_attention():
    config = tiny_config(num_layers=2)
    model = tiny_model(config)
    model.set_attn_implementation("sdpa")
    cache = FlexiCache(model.config, token_budget=32, page_size=8)
    ids = random_prompt(10, seed=0).view(1, -1)
    with pytest.raises(RuntimeError, match="another attn_implementation.*set_attn_implementation\\(\"flexicache\"\\)"):
        greedy(model, ids, cache, None, 3)
    # After following the hint, generation works (nothing stale is left behind by the failure).
    cache = FlexiCache.from_model(model, token_budget=32, page_size=8)
    assert model.config._attn_implementation == ATTENTION_NAME
    out = greedy(model, ids, cache, None, 3)
    assert torch.equal(out, greedy(model, ids, DynamicCache(config=model.config), None, 3))


def test_single_layer_model_not_switched_is_caught_at_the_next_step():
    config = tiny_config(num_layers=1)
    model = tiny_model(config)
    model.set_attn_implementation("sdpa")
    with pytest.raises(RuntimeError, match="another attn_implementation"):
        greedy(model, random_prompt(6, seed=0).view(1, -1), FlexiCache(model.config, token_budget=32, page_size=8),
               None, 3)


def test_flexicache_attention_without_a_flexicache_is_sdpa():
    config = tiny_config(num_layers=2)
    model = tiny_model(config)
    ids = random_prompt(20, seed=1).view(1, -1)
    model.set_attn_implementation("sdpa")
    expected = model(ids).logits
    dense = greedy(model, ids, DynamicCache(config=config), None, 5)
    model.set_attn_implementation(ATTENTION_NAME)
    torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=1e-12)  # no cache at all
    assert torch.equal(greedy(model, ids, DynamicCache(config=config), None, 5), dense)


def test_unsupported_attention_kwargs_are_refused():
    config = tiny_config(group=2, num_kv_heads=2, num_layers=1, head_dim=8)
    cache = FlexiCache(config, token_budget=32, page_size=8)
    driver = Driver(config, cache)
    driver.prefill([10])
    k = torch.randn(1, 2, 1, 8, dtype=torch.float64)
    key, value = cache.update(k, k, 0)
    with pytest.raises(NotImplementedError, match="softcap"):
        flexicache_attention_forward(FakeAttention(0, 2), torch.randn(1, 4, 1, 8, dtype=torch.float64), key, value,
                                     None, softcap=30.0)


def test_batch_size_change_without_reset_is_refused():
    config = tiny_config(num_layers=2)
    model = tiny_model(config)
    cache = FlexiCache.from_model(model, token_budget=32, page_size=8)
    greedy(model, random_prompt(6, seed=0).view(1, -1), cache, None, 2)
    ids = torch.stack([random_prompt(8, seed=1), random_prompt(8, seed=2)])
    with pytest.raises(ValueError, match="holds a batch of 1 requests, got 2: call cache.reset"):
        greedy(model, ids, cache, None, 2)


@pytest.mark.parametrize("profile", [None, "default"])
def test_an_empty_batch_is_refused_clearly_and_leaves_the_cache_empty(profile):
    config = tiny_config(num_layers=2)
    cache = FlexiCache(config, profile=profile, token_budget=32, page_size=8)
    empty = torch.zeros(0, config.num_key_value_heads, 5, config.head_dim)
    with pytest.raises(ValueError, match="a batch of no requests"):
        cache.update(empty, empty, 0)
    assert cache.get_seq_length() == 0 and not cache.layers[0].is_initialized


def test_real_tokens_of_chunk_reads_bool_and_float_masks():
    bool_mask = torch.tensor([[False, True, True], [True, True, True]]).view(2, 1, 1, 3)
    assert real_tokens_of_chunk(bool_mask, 0, 3).tolist() == [[False, True, True], [True, True, True]]
    assert real_tokens_of_chunk(bool_mask, 1, 2) is None
    float_mask = torch.where(bool_mask, 0.0, torch.finfo(torch.float32).min)
    assert real_tokens_of_chunk(float_mask, 0, 3).tolist() == [[False, True, True], [True, True, True]]
    assert real_tokens_of_chunk(None, 0, 3) is None
    with pytest.raises(ValueError, match="covers"):
        real_tokens_of_chunk(bool_mask, 2, 3)


def test_a_model_for_a_config_a_config_for_a_model_and_a_mistyped_profile_name_are_refused_clearly() -> None:
    config = tiny_config(num_layers=2)
    model = tiny_model(config)
    with pytest.raises(TypeError, match=r"config must be the model's config \(model.config\)"):
        FlexiCache(model, token_budget=32)
    with pytest.raises(TypeError, match="from_model takes the model"):
        FlexiCache.from_model(model.config, token_budget=32)
    with pytest.raises(FileNotFoundError, match="No profile file 'Default'.*profile=None.*profile='default'"):
        FlexiCache(config, profile="Default", token_budget=32)
    assert model.config._attn_implementation != ATTENTION_NAME  # nothing refused switched the model


def test_unsigned_request_indices_select_like_signed_ones() -> None:
    config = tiny_config(num_layers=2)
    model = tiny_model(config)
    ids = torch.stack([random_prompt(20, seed=seed) for seed in (3, 4, 5)])  # three different requests
    caches = [FlexiCache.from_model(model, token_budget=32) for _ in range(2)]
    for cache in caches:
        greedy(model, ids, cache, max_new_tokens=2)
    before = [layer.read_logical()[0] for layer in caches[0].layers]  # [3, H, L, D] per layer
    caches[0].batch_select_indices(torch.tensor([2, 0], dtype=torch.uint8))
    caches[1].batch_select_indices(torch.tensor([2, 0]))
    assert caches[0].get_seq_length() == caches[1].get_seq_length()
    for layer, signed, keys in zip(caches[0].layers, caches[1].layers, before):
        assert torch.equal(layer.read_logical()[0], keys[[2, 0]])  # the requests asked for, in that order
        assert torch.equal(layer.read_logical()[0], signed.read_logical()[0])
