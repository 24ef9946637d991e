"""The oracle page selection: the true top pages of a constructed attention, DynamicCache's tokens at a covering
budget, a padded batch equal to each request alone, and the decode output of an fp64 reference at a small budget."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    dense_cache,
    greedy,
    left_pad,
    masked_attention,
    mixed_profile,
    random_prompt,
    tiny_config,
    tiny_model,
)
from transformers import DynamicCache

import flexicache
from flexicache.oracle import OracleCache, oracle_token_mask


def test_oracle_mask_keeps_the_pages_of_most_mass_with_sink_and_tail() -> None:
    # 6 pages of 2 tokens, 2 query heads: page 3 holds most of head 0's mass, page 2 most of head 1's, page 4 a
    # little of both; sink (0) and tail (5) are forced whatever their mass.
    weights = torch.zeros(1, 2, 12)
    weights[0, 0, [6, 7]] = 0.4
    weights[0, 1, [4, 5]] = 0.35
    weights[0, :, 8] = 0.1
    weights[0, :, [0, 11]] = 0.01
    weights[0, 0, 1] = 0.02
    mask = oracle_token_mask(weights, page_size=2, pages=4)
    assert mask[0].view(6, 2).all(1).tolist() == [True, False, True, True, False, True]
    assert mask.view(1, 6, 2).any(2).equal(mask.view(1, 6, 2).all(2))  # whole pages only
    assert oracle_token_mask(weights, page_size=2, pages=6).all()  # the budget covers the row


def test_oracle_with_a_covering_budget_generates_what_dynamic_cache_generates() -> None:
    config = tiny_config(group=3, num_kv_heads=2)
    model = tiny_model(config).to(torch.float64)
    model.set_attn_implementation("flexicache")
    ids = random_prompt(29, seed=3).view(1, -1)
    reference, reference_logits = greedy(model, ids, dense_cache(model), max_new_tokens=12, logits=True)
    tokens, logits = greedy(model, ids, OracleCache(config, token_budget=48, page_size=4), max_new_tokens=12,
                            logits=True)
    assert torch.equal(tokens, reference)
    for ours, theirs in zip(logits, reference_logits):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-10)


def test_oracle_left_padded_batch_equals_each_request_alone() -> None:
    config = tiny_config(group=2, num_kv_heads=2)
    model = tiny_model(config, seed=1)
    model.set_attn_implementation("flexicache")
    prompts = [random_prompt(41, seed=5), random_prompt(26, seed=6)]
    ids, mask = left_pad(prompts)
    batch = greedy(model, ids, OracleCache(config, token_budget=16, page_size=4), mask, max_new_tokens=10)
    for row, prompt in enumerate(prompts):
        alone = greedy(model, prompt.view(1, -1), OracleCache(config, token_budget=16, page_size=4),
                       max_new_tokens=10)
        assert torch.equal(batch[row, -10:], alone[0, -10:])


def test_oracle_decode_equals_attention_over_the_true_top_pages() -> None:
    config = tiny_config(group=2, num_kv_heads=2, num_layers=1)
    model = tiny_model(config, seed=2)
    model.set_attn_implementation("flexicache")
    cache = OracleCache(config, token_budget=12, page_size=4)
    ids = random_prompt(30, seed=7).view(1, -1)
    dense = DynamicCache(config=config)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        model(input_ids=ids, past_key_values=dense, use_cache=True)
    layer = cache.layers[0]
    query = torch.randn(1, 4, 1, 8, dtype=torch.float64)
    keys, values = torch.randn(2, 1, 2, 1, 8, dtype=torch.float64).unbind(0)
    layer.update(keys, values)
    chunk = flexicache.handoff.take(0)
    output = layer.decode(chunk, query, scale=0.3)[0, 0]  # [Hq, D]
    # the reference reads the prompt's KV from a DynamicCache and the new token as passed, not the oracle's storage
    all_keys = torch.cat([dense.layers[0].keys, keys], dim=2)[0]  # [H, 31, D]
    all_values = torch.cat([dense.layers[0].values, values], dim=2)[0]
    assert torch.equal(layer.keys[0], all_keys) and torch.equal(layer.values[0], all_values)
    for head in range(2):
        group = query[0, 2 * head : 2 * head + 2, 0]
        weights = torch.softmax(group @ all_keys[head].T * 0.3, dim=-1)  # [G, 31]
        mass = torch.nn.functional.pad(weights.sum(0), (0, 1)).view(8, 4).sum(1)
        best = sorted(set(range(1, 7)), key=lambda page: -float(mass[page]))[:1]  # 3 pages: sink, tail, 1 more
        tokens = [t for page in sorted({0, 7, *best}) for t in range(4 * page, min(4 * page + 4, 31))]
        expected = masked_attention(group, all_keys[head, tokens], all_values[head, tokens], 0.3)
        torch.testing.assert_close(output[2 * head : 2 * head + 2], expected, rtol=0, atol=1e-12)


def test_candidate_mask_restricts_the_oracle_choice() -> None:
    weights = torch.zeros(1, 1, 12)
    weights[0, 0, [6, 7]] = 0.5  # page 3: most mass, but not a candidate
    weights[0, 0, [4, 5]] = 0.2  # page 2
    weights[0, 0, 8] = 0.1  # page 4
    candidates = torch.tensor([[True, True, True, False, True, True]])
    mask = oracle_token_mask(weights, page_size=2, pages=4, candidates=candidates)
    assert mask[0].view(6, 2).all(1).tolist() == [True, False, True, False, True, True]


def test_two_stage_oracle_lies_between_flexicaches_pages_and_the_oracles() -> None:
    """With candidates the oracle attends to pages among the top n x K by the box scores: at n = 1 exactly
    FlexiCache's selection by box scores alone (every head reranked every step), with every page a candidate the plain oracle; a
    covering budget generates DynamicCache's tokens, a left-padded batch each request's alone."""
    config = tiny_config(group=2, num_kv_heads=2, num_layers=1)
    model = tiny_model(config, seed=2).to(torch.float64)
    model.set_attn_implementation("flexicache")
    ids = random_prompt(60, seed=8).view(1, -1)
    reference = greedy(model, ids, dense_cache(model), max_new_tokens=6)
    assert torch.equal(greedy(model, ids, OracleCache(config, token_budget=64, page_size=4, candidates=2),
                              max_new_tokens=6), reference)
    unstable = mixed_profile(config)  # one layer: all its heads unstable (rerank every step)
    flexi = greedy(model, ids, flexicache.FlexiCache(config, profile=unstable, token_budget=12, page_size=4,
                                                     exact_rescore=False), max_new_tokens=6)
    assert torch.equal(greedy(model, ids, OracleCache(config, token_budget=12, page_size=4,
                                                      candidates=torch.tensor(1)), max_new_tokens=6), flexi)
    assert torch.equal(greedy(model, ids, OracleCache(config, token_budget=12, page_size=4, candidates=100),
                              max_new_tokens=6), greedy(model, ids, OracleCache(config, token_budget=12, page_size=4),
                                                        max_new_tokens=6))
    prompts = [random_prompt(41, seed=5), random_prompt(26, seed=6)]
    padded, mask = left_pad(prompts)
    batch = greedy(model, padded, OracleCache(config, token_budget=12, page_size=4, candidates=2), mask,
                   max_new_tokens=5)
    for row, prompt in enumerate(prompts):
        alone = greedy(model, prompt.view(1, -1), OracleCache(config, token_budget=12, page_size=4, candidates=2),
                       max_new_tokens=5)
        assert torch.equal(batch[row, -5:], alone[0, -5:])


def test_oracle_keeps_the_windows_of_a_hybrid_model() -> None:
    from hybrid_models import EXPECTED_SPARSE, family_model

    from flexicache.sliding import SlidingWindowLayer

    model = family_model("gemma3")
    ids = random_prompt(45, seed=8).view(1, -1)  # past the 16-token window
    reference = greedy(model, ids, dense_cache(model), max_new_tokens=10)
    cache = OracleCache(model.config, token_budget=128, page_size=4)
    assert torch.equal(greedy(model, ids, cache, max_new_tokens=10), reference)
    paged = [index for index, layer in enumerate(cache.layers) if not isinstance(layer, SlidingWindowLayer)]
    assert paged == EXPECTED_SPARSE["gemma3"]


def test_diagnostic_traces_the_paged_layers_of_a_hybrid_model() -> None:
    from hybrid_models import EXPECTED_SPARSE, family_model

    from flexicache.diagnostics.trace import record_trace

    model = family_model("gemma3", attn_implementation="sdpa")
    trace = record_trace(model, random_prompt(40, seed=9).tolist(), prefill=34, progress=False)
    assert trace.layers == EXPECTED_SPARSE["gemma3"] and trace.keys.shape[0] == len(trace.layers)
    assert trace.keys.shape[2] == 40 and trace.queries.shape[:2] == (6, len(trace.layers))


@pytest.mark.parametrize("candidates", [1.5, True, -1, "2"])
def test_candidates_that_are_not_a_count_are_refused(candidates):
    with pytest.raises(ValueError, match="candidates must be"):
        OracleCache(tiny_config(), token_budget=12, page_size=4, candidates=candidates)
