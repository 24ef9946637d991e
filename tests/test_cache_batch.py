"""A left-padded batch of different lengths generates what each request generates alone (same cache settings),
with sparse budgets much smaller than the context."""

from __future__ import annotations

import pytest
import torch
from conftest import checked, greedy, left_pad, mixed_profile, random_prompt, tiny_config, tiny_model

from flexicache import FlexiCache


@pytest.mark.parametrize("family,group,lengths,budget,page_size,interval", [
    ("llama", 2, (200, 150, 120), 64, 16, 4),
    ("qwen2", 4, (180, 97, 33, 201), 32, 8, 3),
    ("mistral", 1, (130, 64), 48, 4, 16),
])
def test_left_padded_batch_equals_each_request_alone(family, group, lengths, budget, page_size, interval):
    config = tiny_config(family, group=group, num_kv_heads=2, num_layers=3)
    model = tiny_model(config, seed=len(lengths))
    profile = mixed_profile(config)
    settings = {"profile": profile, "token_budget": budget, "page_size": page_size, "rerank_interval": interval}
    prompts = [random_prompt(n, seed=100 + i) for i, n in enumerate(lengths)]
    new_tokens = 24
    ids, mask = left_pad(prompts)
    batch_cache = checked(FlexiCache.from_model(model, **settings))
    batch_out, batch_logits = greedy(model, ids, batch_cache, mask, new_tokens, logits=True)
    stats = batch_cache.stats()
    assert stats["reranks_stable"] > 0 and stats["promoted_pages"] > 0
    for row, prompt in enumerate(prompts):
        alone_cache = checked(FlexiCache.from_model(model, **settings))
        alone_out, alone_logits = greedy(model, prompt.view(1, -1), alone_cache, None, new_tokens, logits=True)
        assert torch.equal(batch_out[row, ids.shape[1]:], alone_out[0, prompt.numel():]), f"request {row}"
        for step, (ours, theirs) in enumerate(zip(batch_logits, alone_logits)):
            torch.testing.assert_close(ours[row], theirs[0], rtol=0, atol=1e-9, msg=f"request {row} step {step}")


def test_sparse_budget_actually_sparse():
    """The budget is smaller than the context here, so FlexiCache must differ from dense attention somewhere:
    otherwise the batch test above would be vacuous."""
    config = tiny_config("llama", group=2, num_kv_heads=2, num_layers=3)
    model = tiny_model(config, seed=3)
    prompt = random_prompt(200, seed=100).view(1, -1)
    from conftest import dense_cache

    _, dense_logits = greedy(model, prompt, dense_cache(model), None, 6, logits=True)
    cache = FlexiCache.from_model(model, profile=mixed_profile(config), token_budget=64, page_size=16)
    _, sparse_logits = greedy(model, prompt, cache, None, 6, logits=True)
    assert torch.equal(dense_logits[0], sparse_logits[0])  # prefill is dense
    assert max(float((a - b).abs().max()) for a, b in zip(dense_logits[1:], sparse_logits[1:])) > 1e-6


def test_batch_invariance_layer_level_with_zero_query_and_padding_junk():
    """Driven directly: padding positions carry junk keys/values (they must never be read), one decode step has
    an all-zero query (every page ties), and the batch must still equal each request alone, step by step."""
    from conftest import Driver

    from flexicache import HeadProfile

    config = tiny_config("llama", group=2, num_kv_heads=2, num_layers=2, head_dim=8)
    profile = HeadProfile(2, 2, 8, [(0, 0), (1, 1)])
    settings = {"profile": profile, "token_budget": 16, "page_size": 4, "rerank_interval": 3}
    lengths, steps = [41, 26, 9], 14
    generator = torch.Generator().manual_seed(0)
    total = max(lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    # per request, per layer: prompt q/k/v [1, H, n, D] and decode q/k/v [steps][1, H, 1, D]
    prompt = [[(randn(1, 4, n, 8), randn(1, 2, n, 8), randn(1, 2, n, 8)) for _ in range(2)] for n in lengths]
    decode = [[[(randn(1, 4, 1, 8), randn(1, 2, 1, 8), randn(1, 2, 1, 8)) for _ in range(2)] for _ in range(steps)]
              for _ in lengths]
    for request in decode:
        for layer in request[5]:
            layer[0].zero_()  # step 5: zero query in every layer

    def padded(tensors, n):
        junk = 1e3 * randn(1, tensors.shape[1], total - n, 8)
        return torch.cat([junk, tensors], dim=2)

    batch = Driver(config, checked(FlexiCache(config, **settings)))
    batch.prefill(lengths, q=[torch.cat([padded(prompt[b][l][0], n) for b, n in enumerate(lengths)]) for l in range(2)],
                  k=[torch.cat([padded(prompt[b][l][1], n) for b, n in enumerate(lengths)]) for l in range(2)],
                  v=[torch.cat([padded(prompt[b][l][2], n) for b, n in enumerate(lengths)]) for l in range(2)])
    alone = [Driver(config, checked(FlexiCache(config, **settings))) for _ in lengths]
    for b, driver in enumerate(alone):
        driver.prefill([lengths[b]], q=[prompt[b][l][0] for l in range(2)], k=[prompt[b][l][1] for l in range(2)],
                       v=[prompt[b][l][2] for l in range(2)])
    for step in range(steps):
        batch.decode(q=[torch.cat([decode[b][step][l][0] for b in range(3)]) for l in range(2)],
                     k=[torch.cat([decode[b][step][l][1] for b in range(3)]) for l in range(2)],
                     v=[torch.cat([decode[b][step][l][2] for b in range(3)]) for l in range(2)])
        for b, driver in enumerate(alone):
            driver.decode(q=[decode[b][step][l][0] for l in range(2)], k=[decode[b][step][l][1] for l in range(2)],
                          v=[decode[b][step][l][2] for l in range(2)])
            for layer in range(2):
                torch.testing.assert_close(batch.outputs[layer][b], driver.outputs[layer][0], rtol=0, atol=1e-12,
                                           msg=f"step {step} request {b} layer {layer}")
