"""Stable heads without standby pages (the paper's): a page outside the top-K that becomes important is promoted at
the next rerank, not before, and only newly promoted pages are copied host -> device."""

from __future__ import annotations

import torch
from conftest import Driver, checked, masked_attention, tiny_config

from flexicache import FlexiCache, HeadProfile

D, PS = 4, 8  # head dim, page size
E1, E2 = torch.eye(D, dtype=torch.float64)[0], torch.eye(D, dtype=torch.float64)[1]


def crafted_prompt() -> torch.Tensor:
    """``[1, 1, 42, D]`` keys: pages 0..4 full, page 5 (tail) holds 2 tokens.

    Under q = e2 the scores of pages 1..4 are 5, 0, 3, -1 -> top-2 = {1, 3}; under q = e1 they are 0, 5, 1, -1 ->
    top-2 = {2, 3}: page 2 becomes important when the query turns to e1.
    """
    page_keys = [0.1 * E1 + 0.1 * E2, 5 * E2, 5 * E1, 3 * E2 + E1, -E1 - E2, torch.zeros(D, dtype=torch.float64)]
    keys = torch.cat([key.expand(PS, D) for key in page_keys])[:42]
    return keys.view(1, 1, 42, D).clone()


def test_page_promoted_at_next_rerank_and_not_before():
    config = tiny_config(group=1, num_kv_heads=1, num_layers=1, head_dim=D)
    cache = checked(FlexiCache(config, profile=HeadProfile(1, 1, D, []), token_budget=4 * PS, page_size=PS,
                               rerank_interval=4, standby_pages=0))  # K = 4: sink + 2 selected + tail
    layer = cache.layers[0]
    driver = Driver(config, cache)
    keys = crafted_prompt()
    values = torch.randn(1, 1, 42, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    query = torch.zeros(1, 1, 42, D, dtype=torch.float64)
    query[0, 0, -1] = E2
    driver.prefill([42], q=[query], k=[keys], v=[values])
    off = layer.storage.offloaded
    assert sorted(p for p in off.selected[0].tolist() if p >= 0) == [0, 1, 3]
    page_bytes = 2 * PS * D * 8
    promoted, h2d = off.counters.promoted_pages, off.counters.bytes_h2d
    assert promoted == 3
    assert h2d == (3 + 1) * page_bytes  # the three selected pages + the tail page, nothing else

    def step(q: torch.Tensor) -> None:  # neutral new token: zero key, so pages 0..4 keep their ranking
        driver.decode(q=[q.view(1, 1, 1, D)], k=[torch.zeros(1, 1, 1, D, dtype=torch.float64)],
                      v=[torch.ones(1, 1, 1, D, dtype=torch.float64)])

    step(E2)
    step(E2)
    step(E1)  # page 2 is now the best page, but the next rerank is one step away
    assert 2 not in off.selected[0].tolist()
    assert (off.counters.promoted_pages, off.counters.bytes_h2d) == (promoted, h2d), "promoted before the rerank"
    reranks = off.counters.reranks
    step(E1)  # 4th decode step since the prefill rerank
    assert off.counters.reranks == reranks + 1
    assert sorted(p for p in off.selected[0].tolist() if p >= 0) == [0, 2, 3]
    assert off.counters.promoted_pages == promoted + 1, "only page 2 is new; 0 and 3 stay"
    assert off.counters.bytes_h2d == h2d + page_bytes
    slot = off.selected[0].tolist().index(2)
    assert torch.equal(layer.storage.pool.k[off.base + slot], keys[0, 0, 2 * PS:3 * PS])
    assert torch.equal(layer.storage.pool.v[off.base + slot], values[0, 0, 2 * PS:3 * PS])
    # the output now attends to page 2
    all_keys, all_values = driver.real_kv(0, 0)
    tokens = torch.cat([torch.arange(p * PS, (p + 1) * PS) for p in (0, 2, 3)] + [torch.arange(40, 46)])
    expected = masked_attention(E1.view(1, D), all_keys[0, tokens], all_values[0, tokens], D ** -0.5)
    torch.testing.assert_close(driver.outputs[0][0, 0], expected, rtol=0, atol=1e-12)


def test_unstable_head_follows_the_query_every_step():
    """The same crafted keys on an unstable head: page 2 is used at the very step the query turns to e1."""
    config = tiny_config(group=1, num_kv_heads=1, num_layers=1, head_dim=D)
    cache = checked(FlexiCache(config, profile=HeadProfile(1, 1, D, [(0, 0)]), token_budget=4 * PS, page_size=PS,
                               rerank_interval=4))
    driver = Driver(config, cache)
    keys = crafted_prompt()
    values = torch.randn(1, 1, 42, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    driver.prefill([42], q=[torch.zeros(1, 1, 42, D, dtype=torch.float64)], k=[keys], v=[values])
    for q, pages in ((E2, (0, 1, 3)), (E1, (0, 2, 3))):
        driver.decode(q=[q.view(1, 1, 1, D)], k=[torch.zeros(1, 1, 1, D, dtype=torch.float64)],
                      v=[torch.ones(1, 1, 1, D, dtype=torch.float64)])
        all_keys, all_values = driver.real_kv(0, 0)
        n = all_keys.shape[1]
        tokens = torch.cat([torch.arange(p * PS, (p + 1) * PS) for p in pages] + [torch.arange(40, n)])
        expected = masked_attention(q.view(1, D), all_keys[0, tokens], all_values[0, tokens], D ** -0.5)
        torch.testing.assert_close(driver.outputs[0][0, 0], expected, rtol=0, atol=1e-12)
    assert cache.stats()["promoted_pages"] == 0 and cache.stats()["bytes_h2d"] == 0  # resident: no transfers


def test_rerank_copies_only_pages_not_already_on_the_device():
    """Over a long decode with random queries: every rerank copies exactly the pages of the new selection that its
    slots did not hold when the rerank started (retired tails included), and nothing happens between reranks."""
    config = tiny_config(group=2, num_kv_heads=2, num_layers=1, head_dim=D)
    cache = checked(FlexiCache(config, profile=HeadProfile(1, 2, D, []), token_budget=4 * PS, page_size=PS,
                               rerank_interval=3))
    driver = Driver(config, cache, seed=4)
    driver.prefill([50, 23])
    off = cache.layers[0].storage.offloaded
    page_bytes = 2 * PS * D * 8
    on_device_at_rerank = []
    rerank = off.rerank

    def spy(scores, num_full_pages, max_promotions=None):
        on_device_at_rerank.append(off.selected.clone())
        rerank(scores, num_full_pages, max_promotions)

    off.rerank = spy
    for step in range(40):
        on_device_at_rerank.clear()
        promoted, h2d = off.counters.promoted_pages, off.counters.bytes_h2d
        driver.decode()
        new_pages = 0
        if (step + 1) % 3 == 0:
            assert len(on_device_at_rerank) == 1
            for row in range(off.num_rows):
                old = {p for p in on_device_at_rerank[0][row].tolist() if p >= 0}
                new_pages += len({p for p in off.selected[row].tolist() if p >= 0} - old)
        else:
            assert not on_device_at_rerank
        assert off.counters.promoted_pages - promoted == new_pages
        assert off.counters.bytes_h2d - h2d == new_pages * page_bytes
    assert off.counters.promoted_pages > 9  # the random queries did move the selection
