"""The online head split (``profile=None`` / ``"online"``, flexicache.head_split): the lowest quarter over every
layer's heads, ties, short prompts, the first chunks parked until the last layer (then stored exactly as with a
profile of the same heads), its place in a cache's prefill (again after a reset and after a failed forward), and
generation at a covering budget equal to DynamicCache's."""

from __future__ import annotations

import math
import weakref

import pytest
import torch
from conftest import (
    assert_batch_matches_alone,
    assert_same_generation,
    checked,
    dense_cache,
    greedy,
    left_pad,
    random_prompt,
    tiny_config,
    tiny_model,
)

from flexicache import FlexiCache, HeadProfile, head_split
from flexicache.config import DEFAULT_UNSTABLE_FRACTION, FlexiCacheConfig
from flexicache.forward_guard import planned_stable_heads
from flexicache.handoff import StagedChunk
from flexicache.head_split import OnlineHeadSplit, unstable_heads_by_score
from flexicache.profiling.stability import lowest_count

SETTINGS = FlexiCacheConfig(token_budget=32, page_size=16)
QUARTER = DEFAULT_UNSTABLE_FRACTION
NAN = float("nan")


def rows(*scores: list[float]) -> list[torch.Tensor]:
    return [torch.tensor(row, dtype=torch.float32) for row in scores]


def test_the_lowest_quarter_of_every_layers_heads_is_unstable() -> None:
    scores = rows([0.9, 0.2, 0.8, 0.7], [0.95, 0.9, 0.85, 0.99], [0.1, 0.15, 0.9, 0.9])
    assert unstable_heads_by_score(scores, [[0]] * 3, QUARTER) == [[1], [], [0, 1]]  # 3 of 12, wherever they are


@pytest.mark.parametrize("order", ["rising", "falling"])
def test_stability_that_changes_with_depth_puts_every_unstable_head_where_it_is_lowest(order: str) -> None:
    """30 layers of 8 heads whose scores rise (or fall) with depth: a quarter of 240 heads, all in the 8 layers
    of lowest scores (a split decided layer by layer could not know that the first layers are the least stable)."""
    levels = range(30) if order == "rising" else range(30, 0, -1)
    chosen = unstable_heads_by_score(rows(*([level + head / 10 for head in range(8)] for level in levels)), [[]] * 30,
                                     QUARTER)
    full, partial = (range(7), 7) if order == "rising" else (range(23, 30), 22)  # 7 layers of 8, then 4 heads
    expected = [list(range(8)) if layer in full else [0, 1, 2, 3] if layer == partial else [] for layer in range(30)]
    assert chosen == expected


def test_never_fewer_unstable_heads_than_the_default_profile() -> None:
    """Six layers of one head: a quarter is two heads, the default profile's three (its first three layers) is the
    floor, and the three lowest scores are chosen wherever they are."""
    scores = rows([0.9], [0.1], [0.5], [0.7], [0.3], [0.8])
    assert unstable_heads_by_score(scores, [[0]] * 3 + [[]] * 3, QUARTER) == [[], [0], [0], [], [0], []]
    assert head_split.unstable_count(6, 3, QUARTER) == 3 and head_split.unstable_count(48, 4, QUARTER) == 12
    assert head_split.unstable_count(4, 2, QUARTER) == 2 and head_split.unstable_count(5, 9, QUARTER) == 5


def test_fewer_than_four_paged_heads_are_all_unstable() -> None:
    """Gemma-3-270M's three paged heads (one per global layer): none stays stable, whatever the scores, the fraction
    and a layer too short to tell; four heads are split (a layer without scores keeps its fallback)."""
    assert head_split.too_few_to_split(3) and not head_split.too_few_to_split(4)
    assert unstable_heads_by_score(rows([0.9], [0.1], [0.5]), [[0], [0], []], QUARTER) == [[0], [0], [0]]
    assert unstable_heads_by_score(rows([0.9], [0.1], [0.5]), [[], [], []], 0.01) == [[0], [0], [0]]
    assert unstable_heads_by_score(rows([NAN], [0.1, 0.2]), [[], []], QUARTER) == [[0], [0, 1]]
    assert unstable_heads_by_score(rows([NAN, NAN], [0.1, 0.2]), [[], []], QUARTER) == [[], [0]]


def test_a_share_rounds_to_a_head_count_as_the_offline_profiler_rounds() -> None:
    """Halves up, else to the nearest (the profiler's ``lowest_count``): a quarter of 9 heads is 2, of 10 is 3."""
    assert head_split.unstable_count(9, 1, QUARTER) == lowest_count(9, QUARTER) == 2
    assert head_split.unstable_count(10, 1, QUARTER) == lowest_count(10, QUARTER) == 3


def test_the_unstable_fraction_sets_the_share_of_the_scored_heads() -> None:
    scores = rows([0.9, 0.2, 0.8, 0.7], [0.95, 0.9, 0.85, 0.99], [0.1, 0.15, 0.9, 0.9])
    assert unstable_heads_by_score(scores, [[0]] * 3, 0.5) == [[1, 2, 3], [2], [0, 1]]  # the lowest 6 of 12
    assert unstable_heads_by_score(scores, [[0]] * 3, 1.0) == [[0, 1, 2, 3]] * 3
    assert unstable_heads_by_score(scores, [[0]] * 3, 0.01) == [[1], [], [0, 1]]  # never below the default's 3
    assert head_split.unstable_count(10, 1, 0.3) == 3  # 0.3 x 10 is 3 (not 4, as its float product rounds up)
    assert head_split.unstable_count(10, 1, 0.35) == 4 and head_split.unstable_count(10, 1, 0.01) == 1


def test_ties_go_to_the_earlier_layer_and_head() -> None:
    # a quarter of 8, not every tie
    assert unstable_heads_by_score(rows([0.5] * 4, [0.5] * 4), [[], []], QUARTER) == [[0, 1], []]


def test_a_layer_too_short_to_tell_keeps_its_fallback_and_does_not_count() -> None:
    assert unstable_heads_by_score(rows([NAN] * 3, [0.3, 0.1, 0.2, 0.4]), [[0, 2], [3]], QUARTER) == [[0, 2], [1]]
    assert unstable_heads_by_score(rows([NAN] * 2, [NAN] * 2), [[1], []], QUARTER) == [[1], []]
    # a head without a score stays stable
    assert unstable_heads_by_score(rows([0.3, NAN, 0.2, 0.5]), [[1]], QUARTER) == [[2]]


def test_the_first_chunks_wait_for_the_last_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    scores = iter([[0.9, 0.1], [0.8, 0.7]])
    monkeypatch.setattr(head_split, "request_stability",
                        lambda *args: torch.tensor([next(scores)], dtype=torch.float32))
    split, layers = OnlineHeadSplit(num_layers=2), [torch.nn.Identity(), torch.nn.Identity()]  # any weakref-able
    chunks = [StagedChunk(weakref.ref(layers[index]), index, torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8), 0)
              for index in range(2)]
    query = torch.arange(1 * 4 * 5 * 8, dtype=torch.float32).view(1, 4, 5, 8)
    assert split.park(chunks[0], query, None, SETTINGS, [0]) == []  # fallbacks: the default's 1 head
    assert len(split.parked) == 1 and split.parked[0].last_query.shape == (1, 4, 1, 8)
    assert torch.equal(split.parked[0].last_query, query[:, :, -1:])
    assert split.parked[0].last_query.untyped_storage().data_ptr() != query.untyped_storage().data_ptr()
    assert split.park(chunks[1], query, None, SETTINGS, []) == [[1], []]
    assert [(entry.layer, entry.chunk) for entry in split.parked] == [(layers[0], chunks[0]), (layers[1], chunks[1])]
    split.release_first()  # the caller stored the first chunk; the second stays parked until it is stored
    assert [entry.layer for entry in split.parked] == [layers[1]] and split.interrupted
    split.reset()
    assert split.parked == [] and not split.interrupted


def test_a_parked_chunk_owns_its_storage(monkeypatch: pytest.MonkeyPatch) -> None:
    """Values that are a view into a fused QKV activation are copied when parked (else the whole activation would
    stay alive until the split); keys and values that own their storage are parked as they are."""
    monkeypatch.setattr(head_split, "request_stability", lambda *args: torch.zeros(1, 2))
    split, layer = OnlineHeadSplit(num_layers=2), torch.nn.Identity()
    qkv = torch.randn(1, 5, 3 * 2 * 8)  # [B, T, (q, k, v) x heads x dim], as a fused projection returns
    values = qkv[..., 2 * 16:].view(1, 5, 2, 8).transpose(1, 2)  # [B, H, T, D] view into qkv
    keys = torch.randn(1, 2, 5, 8)
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool)[:, 0, -1]  # [B, T] view into a 4D mask
    split.park(StagedChunk(weakref.ref(layer), 0, keys, values, 0), torch.zeros(1, 4, 5, 8), mask, SETTINGS, [0])
    parked = split.parked[0]
    assert parked.chunk.keys is keys
    assert torch.equal(parked.chunk.values, values)
    assert parked.chunk.values.untyped_storage().nbytes() == values.numel() * values.element_size()
    assert torch.equal(parked.real_tokens, mask) and parked.real_tokens.untyped_storage().nbytes() == 5


@pytest.mark.parametrize("score", ["staleness", "overlap"])
@pytest.mark.parametrize("where", ["left", "right", "middle"])
def test_a_padded_request_is_estimated_over_its_real_tokens_alone(where: str, score: str) -> None:
    settings = FlexiCacheConfig(token_budget=32, page_size=16, split_score=score)
    generator = torch.Generator().manual_seed(3)
    keys, query = torch.randn(1, 2, 200, 8, generator=generator), torch.randn(1, 4, 200, 8, generator=generator)
    pad = {"left": slice(0, 40), "right": slice(160, 200), "middle": slice(80, 120)}[where]
    real = torch.ones(2, 200, dtype=torch.bool)
    real[1, pad] = False
    batch = head_split.request_stability(query.expand(2, -1, -1, -1), keys.expand(2, -1, -1, -1), real, settings)
    torch.testing.assert_close(batch[0], head_split.request_stability(query, keys, None, settings)[0])
    alone = head_split.request_stability(query[:, :, real[1]], keys[:, :, real[1]], None, settings)[0]
    torch.testing.assert_close(batch[1], alone)
    assert not torch.allclose(batch[0], batch[1])


@pytest.mark.parametrize("score", ["staleness", "overlap"])
def test_the_estimate_of_a_real_prompt_scores_every_head_of_a_long_enough_one(score: str) -> None:
    settings = FlexiCacheConfig(token_budget=32, page_size=16, split_score=score)
    generator = torch.Generator().manual_seed(0)
    keys, query = torch.randn(2, 2, 256, 8, generator=generator), torch.randn(2, 4, 256, 8, generator=generator)
    scores = head_split.request_stability(query, keys, None, settings)
    assert scores.shape == (2, 2) and bool(torch.isfinite(scores).all())
    for request in range(2):  # the batch at once: each request as alone
        torch.testing.assert_close(scores[request], head_split.request_stability(
            query[request:request + 1], keys[request:request + 1], None, settings)[0])
    short = head_split.request_stability(query[:, :, :20], keys[:, :, :20], None, settings)
    assert bool(torch.isnan(short).all())  # 2 pages, a budget of 2 pages: every page is always selected
    padded = torch.ones(2, 256, dtype=torch.bool)
    padded[0, :100] = False  # left padding: only the last 156 tokens of request 0 count
    both = head_split.request_stability(query, keys, padded, settings)
    torch.testing.assert_close(both[0], head_split.request_stability(query[:1, :, 100:], keys[:1, :, 100:], None,
                                                                     settings)[0])
    torch.testing.assert_close(both[1], scores[1])


def recorded_scores(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The batch-averaged head scores ``[H]`` each layer parks (filled as the layers park)."""
    scores: list[torch.Tensor] = []
    estimate = head_split.request_stability

    def record(*args) -> torch.Tensor:
        result = estimate(*args)
        scores.append(result.nanmean(dim=0))
        return result

    monkeypatch.setattr(head_split, "request_stability", record)
    return scores


@pytest.mark.parametrize("fraction", [QUARTER, 0.75])
def test_a_cache_without_a_profile_splits_its_heads_over_every_layer_at_the_first_prompt_chunk(
        monkeypatch: pytest.MonkeyPatch, fraction: float) -> None:
    config = tiny_config(group=2, num_kv_heads=4, num_layers=4)
    model = tiny_model(config, seed=1)
    ids = random_prompt(300, seed=2).view(1, -1)
    cache = checked(FlexiCache.from_model(model, token_budget=48, page_size=16, unstable_fraction=fraction))
    assert cache.head_split is not None and not any(layer.is_initialized for layer in cache.layers)
    scores = recorded_scores(monkeypatch)
    greedy(model, ids, cache, max_new_tokens=4)
    chosen = [layer.unstable_heads for layer in cache.layers]
    flat = torch.stack(scores).flatten()
    assert bool(torch.isfinite(flat).all())
    count = max(math.ceil(len(flat) * fraction), 2 * 4)  # of 16, at least HeadProfile.default's 2 layers x 4
    lowest = flat.argsort(stable=True)[:count].tolist()  # over all layers
    assert chosen == [[head for head in range(4) if layer * 4 + head in lowest] for layer in range(4)]
    assert cache.stats()["unstable_heads"] == count and cache.head_split.parked == []
    for layer in cache.layers:
        assert layer.storage.unstable_heads == layer.unstable_heads
    cache.reset()  # a new prompt is estimated again
    assert all(layer.awaits_head_split for layer in cache.layers)
    greedy(model, random_prompt(300, seed=3).view(1, -1), cache, max_new_tokens=4)
    assert sum(len(layer.unstable_heads) for layer in cache.layers) == count


def test_every_head_unstable_keeps_no_host_tier_and_the_invariants() -> None:
    """``unstable_fraction=1.0``: every head keeps its pages on the device and chooses from all of them at every
    step. A covering budget decodes as DynamicCache does, and a left-padded batch as each request alone (the split
    cannot differ between a batch and its requests: it takes every head)."""
    config = tiny_config(group=2, num_kv_heads=2, num_layers=3)
    model = tiny_model(config, seed=21)
    ids, mask = left_pad([random_prompt(150, seed=22), random_prompt(110, seed=23)])
    assert_same_generation(model, ids, mask, 8, token_budget=256, page_size=8, unstable_fraction=1.0)
    prompts = [random_prompt(180, seed=24), random_prompt(120, seed=25)]
    assert_batch_matches_alone(model, prompts, token_budget=32, page_size=8, unstable_fraction=1.0)
    cache = checked(FlexiCache.from_model(model, token_budget=32, page_size=8, unstable_fraction=1.0))
    greedy(model, ids, cache, mask, max_new_tokens=20)  # past a stable head's rerank interval
    stats = cache.stats()
    assert stats["unstable_heads"] == 6 and stats["host_kv_bytes"] == 0 and stats["promoted_pages"] == 0
    assert all(layer.storage.unstable_heads == [0, 1] for layer in cache.layers)


@pytest.mark.parametrize(("num_layers", "unstable"), [(3, 3), (4, 2)])
def test_a_model_with_fewer_than_four_paged_heads_keeps_none_stable(num_layers: int, unstable: int) -> None:
    """The default fraction on layers of one KV head: three paged heads (as Gemma-3-270M's) are all unstable, with no
    host tier; four leave two stable (the default profile's floor of two unstable)."""
    model = tiny_model(tiny_config(group=2, num_kv_heads=1, num_layers=num_layers), seed=31)
    cache = checked(FlexiCache.from_model(model, token_budget=32, page_size=8))
    greedy(model, random_prompt(200, seed=32).view(1, -1), cache, max_new_tokens=4)
    stats = cache.stats()
    assert stats["unstable_heads"] == unstable and (stats["host_kv_bytes"] == 0) == (unstable == num_layers)


def test_parked_first_chunks_are_stored_as_a_profile_of_the_same_heads_stores_them() -> None:
    """The online split changes which heads are unstable, not how they are stored: a batch (left-padded) decodes
    token for token and logit for logit as with the profile of the heads it chose."""
    config = tiny_config(group=2, num_kv_heads=3, num_layers=3)
    model = tiny_model(config, seed=11)
    ids, mask = left_pad([random_prompt(260, seed=12), random_prompt(200, seed=13)])
    online = checked(FlexiCache.from_model(model, token_budget=48, page_size=8))
    tokens, logits = greedy(model, ids, online, mask, max_new_tokens=10, logits=True)
    unstable = [(layer.layer_idx, head) for layer in online.layers for head in layer.unstable_heads]
    profile = HeadProfile(num_layers=3, num_kv_heads=3, head_dim=config.head_dim, unstable_heads=unstable)
    fixed = checked(FlexiCache.from_model(model, profile=profile, token_budget=48, page_size=8))
    fixed_tokens, fixed_logits = greedy(model, ids, fixed, mask, max_new_tokens=10, logits=True)
    assert torch.equal(tokens, fixed_tokens)
    for step, (a, b) in enumerate(zip(logits, fixed_logits, strict=True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"step {step}")
    assert online.stats() == fixed.stats()


def test_a_first_forward_that_fails_part_way_is_refused_until_a_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    config = tiny_config(group=2, num_kv_heads=2, num_layers=3)
    model = tiny_model(config, seed=14)
    ids = random_prompt(200, seed=15).view(1, -1)
    reference = greedy(model, ids, FlexiCache.from_model(model, token_budget=32, page_size=8), max_new_tokens=6)
    cache = FlexiCache.from_model(model, token_budget=32, page_size=8)
    last = model.model.layers[-1]
    monkeypatch.setattr(last, "forward", lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("stop")))
    with pytest.raises(RuntimeError, match="stop"), torch.inference_mode():
        model(ids, past_key_values=cache)
    assert len(cache.head_split.parked) == 2 and not any(layer.is_initialized for layer in cache.layers)
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match=r"layers \[0, 1\] parked their first prompt chunk.*cache.reset\(\)"):
        greedy(model, ids, cache, max_new_tokens=6)  # nothing was stored: decoding on would lose the prompt
    cache.reset()
    assert cache.head_split.parked == []
    assert torch.equal(greedy(model, ids, cache, max_new_tokens=6), reference)


def test_a_failure_while_the_parked_chunks_are_stored_is_refused_until_a_reset(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The decision made, the first layer's storage fails (e.g. out of memory): no layer holds the prompt, and the
    next forward raises (dropping the chunks still parked) until a reset, instead of decoding without the prompt."""
    config = tiny_config(group=2, num_kv_heads=2, num_layers=3)
    model = tiny_model(config, seed=14)
    ids = random_prompt(200, seed=15).view(1, -1)
    reference = greedy(model, ids, FlexiCache.from_model(model, token_budget=32, page_size=8), max_new_tokens=6)
    cache = FlexiCache.from_model(model, token_budget=32, page_size=8)
    first = cache.layers[0]
    monkeypatch.setattr(first, "lazy_initialization", lambda *args: (_ for _ in ()).throw(MemoryError("full")))
    with pytest.raises(MemoryError, match="full"), torch.inference_mode():
        model(ids, past_key_values=cache)
    assert len(cache.head_split.parked) == 3 and not any(layer.is_initialized for layer in cache.layers)
    monkeypatch.undo()
    for _ in range(2):  # the first refusal drops the parked chunks; the cache stays refused
        with pytest.raises(RuntimeError, match=r"layers \[0, 1, 2\] parked their first prompt chunk.*cache.reset"):
            greedy(model, ids, cache, max_new_tokens=6)
        assert cache.head_split.parked == []
    cache.reset()
    assert torch.equal(greedy(model, ids, cache, max_new_tokens=6), reference)


def test_a_model_running_fewer_layers_than_the_cache_has_is_refused_at_its_next_forward() -> None:
    """The split waits for the cache's last paged layer: a cache made for a deeper model stores nothing, and the
    next forward raises instead of decoding without the prompt, naming the likely cause (with a profile too)."""
    model = tiny_model(tiny_config(group=2, num_kv_heads=2, num_layers=2), seed=16)
    model.set_attn_implementation("flexicache")
    cache = FlexiCache(tiny_config(group=2, num_kv_heads=2, num_layers=3), token_budget=32, page_size=8)
    deeper = r"If this model's last layer is layer 1, the cache was built for a deeper model.*from_model\(model\)"
    with pytest.raises(RuntimeError, match=r"layers \[0, 1\] parked.*of the cache's 3 paged layers.*" + deeper):
        greedy(model, random_prompt(100, seed=17).view(1, -1), cache, max_new_tokens=3)
    with_profile = FlexiCache(tiny_config(group=2, num_kv_heads=2, num_layers=3), token_budget=32, page_size=8,
                              profile="default")
    with pytest.raises(RuntimeError, match=r"layers \[2\] did not store the last chunk.*" + deeper):
        greedy(model, random_prompt(100, seed=17).view(1, -1), with_profile, max_new_tokens=3)


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


@pytest.mark.parametrize(("fraction", "kept"), [(QUARTER, 0.5), (0.75, 0.25), (1.0, 0.0)])
def test_the_host_tiers_are_planned_for_the_heads_the_split_will_keep_stable(fraction: float, kept: float) -> None:
    """Before the split, the host memory check counts each waiting layer's share of the heads the split will keep
    stable: 16 heads, never fewer unstable than HeadProfile.default's 8, else ``fraction`` of them."""
    cache = FlexiCache(tiny_config(group=2, num_kv_heads=4, num_layers=4), token_budget=32, unstable_fraction=fraction)
    assert all(layer.awaits_head_split for layer in cache.layers)
    assert planned_stable_heads(cache.layers) == [4 * kept] * 4


def test_no_host_tier_is_planned_for_fewer_than_four_paged_heads() -> None:
    cache = FlexiCache(tiny_config(group=2, num_kv_heads=1, num_layers=3), token_budget=32)
    assert planned_stable_heads(cache.layers) == [0.0] * 3
    cache = FlexiCache(tiny_config(group=2, num_kv_heads=1, num_layers=4), token_budget=32)
    assert planned_stable_heads(cache.layers) == [0.5] * 4  # two of four stay stable
