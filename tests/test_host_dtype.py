"""``host_dtype="float8_e4m3fn"``: the stable heads' pages sit in the host tier as 8-bit floats.

What goes through the tier (every prompt token of a stable head) attends rounded to float8 once promoted, keys
rounded about their (request, head)'s centre (the per-channel median of its prompt keys); decode tokens, unstable
heads and the page min/max stay exact. Checked against a dense decode over exactly those rounded keys and values (fp64, ~1e-10),
and in the byte accounting (host bytes and host-device traffic halve per byte of KV dtype they replace)."""

from __future__ import annotations

import pytest
import torch
from conftest import checked, mixed_profile, random_prompt, tiny_config, tiny_model
from transformers import DynamicCache

from flexicache import FlexiCache, FlexiCacheConfig

FP8 = torch.float8_e4m3fn


def greedy_logits(model, ids: torch.Tensor, cache, new_tokens: int, after_prefill=None) -> list[torch.Tensor]:
    """Greedy decode by hand: the prefill, ``after_prefill(cache)``, then one forward per token; each step's logits."""
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True)
        if after_prefill is not None:
            after_prefill(cache)
        logits = [out.logits[:, -1]]
        for _ in range(new_tokens - 1):
            token = logits[-1].argmax(-1, keepdim=True)
            logits.append(model(token, past_key_values=cache, use_cache=True).logits[:, -1])
    return logits


def rounded(tensor: torch.Tensor, centre: torch.Tensor | float = 0.0) -> torch.Tensor:
    """``tensor`` as it comes back from a float8 tier that stores it less ``centre``."""
    return ((tensor - centre).to(FP8).to(tensor.dtype) + centre).to(tensor.dtype)


def round_stable_prompt(profile, prompt_length: int):
    """What the float8 tier does to a DynamicCache after the prefill: the stable heads' prompt KV rounded, the keys
    about their median over the prompt."""

    def apply(cache: DynamicCache) -> None:
        for index, layer in enumerate(cache.layers):
            stable = [head for head in range(layer.keys.shape[1]) if head not in profile.unstable_heads_of(index)]
            keys, values = layer.keys[:, stable, :prompt_length], layer.values[:, stable, :prompt_length]
            layer.keys[:, stable, :prompt_length] = rounded(keys, keys.median(dim=2, keepdim=True).values)
            layer.values[:, stable, :prompt_length] = rounded(values)

    return apply


@pytest.mark.parametrize("prompt_length,page_size", [(37, 8), (48, 16), (5, 4)])
def test_float8_tier_attends_over_the_rounded_prompt(prompt_length, page_size):
    config = tiny_config("llama", group=2, num_kv_heads=2, num_layers=3)
    model = tiny_model(config, seed=prompt_length)
    profile = mixed_profile(config)
    ids = random_prompt(prompt_length, seed=prompt_length).view(1, -1)
    new_tokens = 20
    budget = page_size * -(-(prompt_length + new_tokens) // page_size)  # covers the context: every page attends
    reference = greedy_logits(model, ids, DynamicCache(config=model.config), new_tokens,
                              round_stable_prompt(profile, prompt_length))
    exact = greedy_logits(model, ids, DynamicCache(config=model.config), new_tokens)
    cache = checked(FlexiCache.from_model(model, profile=profile, token_budget=budget, page_size=page_size,
                                          rerank_interval=4, host_dtype="float8_e4m3fn"))
    ours = greedy_logits(model, ids, cache, new_tokens)
    for step, (got, expected) in enumerate(zip(ours, reference)):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-10, msg=f"decode step {step}")
    assert max(float((a - b).abs().max()) for a, b in zip(reference[1:], exact[1:])) > 1e-6  # the rounding shows
    assert all(layer.storage.offloaded.host.k.dtype == FP8 for layer in cache.layers
               if layer.storage.offloaded is not None)


def test_float8_tier_halves_host_bytes_and_traffic_of_16_bit_kv():
    config = tiny_config("llama", group=2, num_kv_heads=2, num_layers=3)
    model = tiny_model(config, seed=3, dtype=torch.bfloat16)
    ids = random_prompt(70, seed=3).view(1, -1)
    stats = {}
    for host_dtype in ("auto", "float8_e4m3fn"):
        cache = FlexiCache.from_model(model, profile=mixed_profile(config), token_budget=96, page_size=8,
                                      rerank_interval=2, host_dtype=host_dtype)  # covers 70 + 24: same moves
        greedy_logits(model, ids, cache, 24)
        stats[host_dtype] = cache.stats()
    auto, fp8 = stats["auto"], stats["float8_e4m3fn"]
    assert fp8["host_kv_bytes"] * 2 == auto["host_kv_bytes"] > 0
    assert fp8["host_reserved_bytes"] * 2 == auto["host_reserved_bytes"]
    assert fp8["device_kv_bytes"] == auto["device_kv_bytes"]
    assert fp8["promoted_pages"] == auto["promoted_pages"] > 0
    assert fp8["bytes_d2h"] * 2 == auto["bytes_d2h"] > 0 and fp8["bytes_h2d"] * 2 == auto["bytes_h2d"] > 0


def test_float8_tier_saturates_keys_beyond_its_range():
    """A key element 448 or more away from its centre is stored as +-448, not as NaN (float8_e4m3fn has no inf);
    the median centre is not dragged by it, so the channel's other tokens come back exact."""
    from conftest import Driver

    config = tiny_config("llama", group=1, num_kv_heads=1, num_layers=1, head_dim=4)
    cache = FlexiCache(config, profile=mixed_profile(config, unstable=[]), token_budget=16, page_size=4,
                       host_dtype="float8_e4m3fn")
    keys = torch.zeros(1, 1, 12, 4, dtype=torch.float64)
    keys[0, 0, 5, 2], keys[0, 0, 6, 1] = 1e4, -1e4
    Driver(config, cache).prefill([12], k=[keys])
    stored = cache.layers[0].storage.offloaded.host.k[0, 0, :3].reshape(12, 4).float()
    assert bool(stored.isfinite().all())
    assert (float(stored[5, 2]), float(stored[6, 1])) == (448.0, -448.0)
    others = torch.ones(12, 4, dtype=torch.bool)
    others[5, 2] = others[6, 1] = False
    assert not bool(stored[others].any())


@pytest.mark.parametrize("bad", ["float8", "int8", torch.float8_e4m3fn, None, 8])
def test_bad_host_dtype_is_refused_with_the_choices(bad):
    with pytest.raises(ValueError, match="host_dtype must be 'auto'.*'float8_e4m3fn'"):
        FlexiCacheConfig(host_dtype=bad)


def test_float8_tier_pages_under_reranks_and_evictions():
    """A small budget over many steps: the tier holds every full page rounded (keys less their row's centre, the
    median of its prompt keys); a selected slot holds a prompt page rounded (it came from the tier), a page retired
    during decode exact or rounded (re-promoted), and the page the prompt ended in, retired from the tail slot, its
    prompt tokens rounded (the tail slot was refreshed from the tier) and its decoded ones exact."""
    from conftest import Driver

    config = tiny_config("llama", group=2, num_kv_heads=2, num_layers=2, head_dim=8)
    profile = mixed_profile(config, unstable=[(0, 0)])
    page_size, prompt = 4, 30
    cache = checked(FlexiCache(config, profile=profile, token_budget=4 * page_size, page_size=page_size,
                               rerank_interval=2, host_dtype="float8_e4m3fn"))
    driver = Driver(config, cache, seed=5)
    driver.prefill([prompt, 21])
    for _ in range(23):
        driver.decode()
    for layer_idx, layer in enumerate(cache.layers):
        off = layer.storage.offloaded
        for b in range(2):
            real_keys, real_values = driver.real_kv(layer_idx, b)
            full_pages = (real_keys.shape[1] - 1) // page_size
            prompt_length = real_keys.shape[1] - 23
            prompt_pages = prompt_length // page_size
            for local, head in enumerate(layer.stable_heads):
                row = b * len(layer.stable_heads) + local
                centre = real_keys[head, : real_keys.shape[1] - 23].median(0).values  # over the prompt's keys
                torch.testing.assert_close(off.key_centre[row], centre, rtol=0, atol=1e-12)
                centre = off.key_centre[row]
                for stored, real, offset in ((off.host.k, real_keys, centre), (off.host.v, real_values, 0.0)):
                    held = stored[b, local, :full_pages].reshape(-1, real.shape[-1])
                    expected = (real[head, : full_pages * page_size] - offset).to(FP8)
                    assert torch.equal(held.float(), expected.float())
                for slot, page in enumerate(off.selected[row].tolist()):
                    if page < 0:
                        continue
                    exact = real_keys[head, page * page_size:(page + 1) * page_size]
                    held = off.pool.k[off.base + row * off.slots_per_row + slot]
                    retired = page >= prompt_pages and torch.equal(held, exact)  # a decode page, still on the device
                    prompt_tokens = prompt_length - page * page_size  # of this page, if the prompt ended in it
                    ended_in = torch.cat([rounded(exact[:prompt_tokens], centre), exact[prompt_tokens:]])
                    assert (torch.equal(held, rounded(exact, centre)) or retired
                            or (0 < prompt_tokens < page_size and torch.equal(held, ended_in)))
