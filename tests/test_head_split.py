"""The online head split (``profile=None`` / ``"online"``, flexicache.head_split): the running fraction, ties, short
prompts, its place in a cache's prefill (decided at the first prompt chunk, again after a reset), and generation at a
covering budget equal to DynamicCache's."""

from __future__ import annotations

import pytest
import torch
from conftest import checked, dense_cache, greedy, left_pad, random_prompt, tiny_config, tiny_model

from flexicache import FlexiCache, HeadProfile, head_split
from flexicache.config import FlexiCacheConfig
from flexicache.head_split import OnlineHeadSplit

SETTINGS = FlexiCacheConfig(token_budget=32, page_size=16)


def decide(split: OnlineHeadSplit, scores: list[float], monkeypatch: pytest.MonkeyPatch,
           fallback: tuple[int, ...] = (0,)) -> list[int]:
    """One layer's decision for given per-head scores (the estimate itself replaced)."""
    monkeypatch.setattr(head_split, "request_stability", lambda *args: torch.tensor([scores], dtype=torch.float32))
    heads = len(scores)
    return split.unstable_heads(torch.zeros(1, heads, 4, 8), torch.zeros(1, heads, 4, 8), None, SETTINGS,
                                list(fallback))


def test_the_fraction_runs_over_the_heads_seen_so_far(monkeypatch: pytest.MonkeyPatch) -> None:
    split = OnlineHeadSplit()
    assert decide(split, [0.9, 0.2, 0.8, 0.7], monkeypatch) == [1]  # lowest quarter of 4
    assert decide(split, [0.95, 0.9, 0.85, 0.99], monkeypatch) == []  # none among the lowest quarter of 8
    assert decide(split, [0.1, 0.15, 0.9, 0.9], monkeypatch) == [0, 1]  # 3 of 12: both of the new lowest
    assert split.num_unstable == 3
    split.reset()
    assert split.scores == [] and split.num_unstable == 0


def test_ties_take_only_what_the_fraction_allows(monkeypatch: pytest.MonkeyPatch) -> None:
    split = OnlineHeadSplit()
    assert decide(split, [0.5] * 4, monkeypatch) == [0]
    assert decide(split, [0.5] * 4, monkeypatch) == [0]
    assert split.num_unstable == 2  # a quarter of 8, not every tied head


@pytest.mark.parametrize("order", ["rising", "falling"])
def test_the_count_stays_near_the_fraction_when_stability_changes_with_depth(monkeypatch, order: str) -> None:
    """30 layers of 8 heads whose scores rise (or fall) with depth: a quarter of 240 heads, within one layer's 8."""
    split = OnlineHeadSplit()
    for layer in range(30):
        level = layer if order == "rising" else 30 - layer
        decide(split, [level + head / 10 for head in range(8)], monkeypatch)
    assert abs(split.num_unstable - 60) <= 8, split.num_unstable


def test_a_prompt_too_short_to_tell_keeps_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    split = OnlineHeadSplit()
    assert decide(split, [float("nan")] * 3, monkeypatch, fallback=(0, 2)) == [0, 2]
    assert split.scores == []


def test_the_estimate_of_a_real_prompt_scores_every_head_of_a_long_enough_one() -> None:
    generator = torch.Generator().manual_seed(0)
    keys, query = torch.randn(2, 2, 256, 8, generator=generator), torch.randn(2, 4, 256, 8, generator=generator)
    scores = head_split.request_stability(query, keys, None, SETTINGS)
    assert scores.shape == (2, 2) and bool(torch.isfinite(scores).all())
    for request in range(2):  # the batch at once: each request as alone
        torch.testing.assert_close(scores[request], head_split.request_stability(
            query[request:request + 1], keys[request:request + 1], None, SETTINGS)[0])
    short = head_split.request_stability(query[:, :, :20], keys[:, :, :20], None, SETTINGS)
    assert bool(torch.isnan(short).all())  # 2 pages, a budget of 2 pages: every page is always selected
    padded = torch.ones(2, 256, dtype=torch.bool)
    padded[0, :100] = False  # left padding: only the last 156 tokens of request 0 count
    both = head_split.request_stability(query, keys, padded, SETTINGS)
    torch.testing.assert_close(both[0], head_split.request_stability(query[:1, :, 100:], keys[:1, :, 100:], None,
                                                                     SETTINGS)[0])
    torch.testing.assert_close(both[1], scores[1])


def test_a_cache_without_a_profile_splits_its_heads_at_the_first_prompt_chunk() -> None:
    config = tiny_config(group=2, num_kv_heads=4, num_layers=4)
    model = tiny_model(config, seed=1)
    ids = random_prompt(300, seed=2).view(1, -1)
    cache = checked(FlexiCache.from_model(model, token_budget=48, page_size=16))
    assert cache.head_split is not None and not any(layer.is_initialized for layer in cache.layers)
    greedy(model, ids, cache, max_new_tokens=4)
    chosen = [layer.unstable_heads for layer in cache.layers]
    count = sum(map(len, chosen))
    assert count == cache.stats()["unstable_heads"] == cache.head_split.num_unstable
    assert 3 <= count <= 6  # about a quarter of 16 (a later layer's heads below the running threshold all count)
    assert chosen != [HeadProfile.default(config).unstable_heads_of(index) for index in range(4)]
    for layer in cache.layers:
        assert layer.storage.unstable_heads == layer.unstable_heads
    cache.reset()  # a new prompt is estimated again
    assert cache.head_split.num_unstable == 0
    greedy(model, random_prompt(300, seed=3).view(1, -1), cache, max_new_tokens=4)
    assert cache.head_split.num_unstable == sum(len(layer.unstable_heads) for layer in cache.layers) >= 3


def test_profile_default_keeps_the_default_profile_and_a_first_single_token_falls_back_to_it() -> None:
    config = tiny_config(group=2, num_kv_heads=2, num_layers=3)
    model = tiny_model(config, seed=4)
    default = [HeadProfile.default(config).unstable_heads_of(index) for index in range(3)]
    cache = FlexiCache.from_model(model, profile="default", token_budget=32)
    assert cache.head_split is None
    greedy(model, random_prompt(100, seed=5).view(1, -1), cache, max_new_tokens=2)
    assert [layer.unstable_heads for layer in cache.layers] == default
    online = FlexiCache.from_model(model, profile="online", token_budget=32)
    with torch.inference_mode():
        model(random_prompt(1, seed=6).view(1, -1), past_key_values=online)  # no prompt to estimate from
    assert [layer.unstable_heads for layer in online.layers] == default


def test_covering_budget_generates_what_dynamic_cache_generates() -> None:
    config = tiny_config(group=2, num_kv_heads=2, num_layers=3)
    model = tiny_model(config, seed=7)
    prompts = [random_prompt(90, seed=8), random_prompt(61, seed=9)]
    ids, mask = left_pad(prompts)
    reference = greedy(model, ids, dense_cache(model), mask, max_new_tokens=12)
    assert torch.equal(greedy(model, ids, FlexiCache.from_model(model, token_budget=256, page_size=8), mask,
                              max_new_tokens=12), reference)


def test_the_window_is_the_shared_prefills_too() -> None:
    from flexicache.evaluation.shared_prefill import TailQueryRecorder

    assert TailQueryRecorder().prefill_tail == head_split.WINDOW
