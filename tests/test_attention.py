"""Sparse decode attention equals dense attention restricted to the selected pages (fp64, independent reference).

A FlexiCache is driven layer by layer with random q/k/v. After every decode step the expected output of every
(request, KV head) is rebuilt from scratch: the tokens come from a DynamicCache fed the same keys/values, the
pages of an unstable head from a Quest top-K written here (with ``exact_rescore``, the default: the K of most
attention mass among the Quest top-2K), the pages of a stable head from its ``selected`` working set (all of it, or
with standby pages its K - 1 best for the step's query: by attention mass, or by box score without
``exact_rescore``) plus the tail (and, at the steps where a
rerank is due, ``selected`` itself must be the Quest top-(K-1+C) of the full pages). The expected output is a plain
softmax over exactly those tokens.
"""

from __future__ import annotations

import pytest
import torch
from conftest import Driver, checked, expected_decode, masked_attention, tiny_config

from flexicache import FlexiCache, HeadProfile

CASES = [
    # page_size, budget, group, lengths, rerank_interval, reduce, unstable heads of (3 layers x 2 KV heads), standby
    pytest.param(4, 16, 2, [37], 3, "max", [(0, 0), (0, 1), (1, 0)], 0, id="single"),
    pytest.param(4, 12, 3, [45, 20, 9], 4, "max", [(0, 1), (1, 0), (1, 1)], 0, id="batch-left-padded"),
    pytest.param(8, 24, 1, [60, 33], 5, "sum", [(0, 0), (1, 1)], 0, id="group1-sum"),
    pytest.param(2, 6, 4, [29, 30], 2, "max", [(0, 0), (2, 1)], 0, id="tiny-pages"),
    pytest.param(4, 8, 2, [21], 7, "max", [(1, 1)], 0, id="K2"),
    pytest.param(4, 256, 2, [30, 11], 3, "max", [(0, 0), (1, 1)], 0, id="budget-covers-context"),
    pytest.param(4, 16, 2, [45, 20, 9], 6, "max", [(0, 1), (1, 0)], 3, id="standby-pages"),
    pytest.param(2, 6, 4, [29, 30], 4, "sum", [(2, 1)], 1, id="standby-K3"),
]


@pytest.mark.parametrize("exact,candidates", [(True, 2), (True, 3), (False, 2)], ids=["exact", "exact-3K", "box"])
@pytest.mark.parametrize("principal", [False, True], ids=["model-axes", "principal-axes"])
@pytest.mark.parametrize("page_size,budget,group,lengths,interval,reduce,unstable,standby", CASES)
def test_sparse_decode_equals_dense_over_selected_pages(page_size, budget, group, lengths, interval, reduce,
                                                        unstable, standby, principal, exact, candidates):
    config = tiny_config(group=group, num_kv_heads=2, num_layers=3, head_dim=8)
    cache = checked(FlexiCache(config, profile=HeadProfile(3, 2, 8, unstable), token_budget=budget,
                               page_size=page_size, rerank_interval=interval, group_reduce=reduce,
                               principal_bounds=principal, standby_pages=standby, exact_rescore=exact,
                               exact_candidates=candidates))
    driver = Driver(config, cache, seed=sum(lengths))
    driver.prefill(lengths)
    since = [layer_idx % interval for layer_idx in range(3)]  # reranks are staggered by layer
    for step in range(3 * interval + 9):
        stable = [layer.storage.offloaded for layer in cache.layers]
        reranks_before = [offloaded.counters.reranks if offloaded else 0 for offloaded in stable]
        driver.decode()
        for layer_idx, layer in enumerate(cache.layers):
            since[layer_idx] += 1
            due = since[layer_idx] >= interval
            if due:
                since[layer_idx] = 0
            if layer.storage.offloaded is not None:
                longest_full = max((int(driver.attention_mask[b].sum()) - 1) // page_size for b in range(len(lengths)))
                rows = len(lengths) * len(layer.stable_heads)
                delta = layer.storage.offloaded.counters.reranks - reranks_before[layer_idx]
                assert delta == (rows if due and longest_full > 0 else 0), f"step {step}: rerank schedule"
            expected = expected_decode(driver, cache, layer_idx, reranked=due)
            torch.testing.assert_close(driver.outputs[layer_idx].double(), expected, rtol=0, atol=1e-12)


def test_budget_covering_context_equals_full_dense_attention():
    """With every page in budget the decode output is plain causal attention over all real tokens."""
    config = tiny_config(group=2, num_kv_heads=2, num_layers=2, head_dim=8)
    cache = FlexiCache(config, profile=HeadProfile(2, 2, 8, [(0, 1)]), token_budget=64, page_size=8,
                       rerank_interval=4)
    driver = Driver(config, cache, seed=5)
    driver.prefill([23, 40])
    for _ in range(20):
        driver.decode()
        for layer_idx in range(2):
            query = driver.queries[layer_idx][:, :, 0]
            for b in range(2):
                keys, values = driver.real_kv(layer_idx, b)
                for qh in range(4):
                    dense = masked_attention(query[b, qh:qh + 1], keys[qh // 2], values[qh // 2], 8 ** -0.5)
                    torch.testing.assert_close(driver.outputs[layer_idx][b, 0, qh:qh + 1], dense, rtol=0, atol=1e-12)


def test_float32_decode_close_to_fp64_reference():
    config = tiny_config(group=2, num_kv_heads=2, num_layers=3, head_dim=8)
    cache = FlexiCache(config, profile=HeadProfile(3, 2, 8, [(0, 0), (1, 1)]), token_budget=16, page_size=4,
                       rerank_interval=3)
    driver = Driver(config, cache, seed=11, dtype=torch.float32)
    driver.prefill([30, 17])
    for step in range(12):
        driver.decode()
        for layer_idx in range(3):
            assert driver.outputs[layer_idx].dtype == torch.float32
            expected = expected_decode(driver, cache, layer_idx, reranked=False)
            torch.testing.assert_close(driver.outputs[layer_idx].double(), expected, rtol=1e-5, atol=1e-5)
