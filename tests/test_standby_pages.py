"""``standby_pages``: a stable head keeps ``C`` more pages than it attends to on the device (its working set is its
rerank's top ``K - 1 + C``), and at every decode step attends to the working set's ``K - 1`` best pages for that
step's query. The rule against a brute-force reference, no copy between reranks, the byte accounting, the invariants
(covering budget == DynamicCache, left-padded batch == alone, stored pages exact through crops and reorders), bad
values refused. Decode attention against dense attention over the attended pages: tests/test_attention.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import (
    Driver,
    assert_batch_matches_alone,
    assert_same_generation,
    check_layer_state,
    checked,
    greedy,
    mixed_profile,
    random_prompt,
    tiny_config,
    tiny_model,
)
from hypothesis import given
from hypothesis import strategies as st

from flexicache import FlexiCache, HeadProfile
from flexicache.config import MAX_WORKING_SET_SLOTS, FlexiCacheConfig
from flexicache.offload import OffloadedPages
from flexicache.paging import PagePool
from flexicache.selection import attended_slots


@given(st.integers(1, 4), st.integers(1, 10), st.integers(0, 10), st.integers(0, 2**31 - 1), st.booleans(),
       st.booleans())
def test_attended_slots_are_the_best_held_slots(rows, width, count, seed, ties, infinite):
    """Held slots only (an empty slot never displaces a held one, even one scoring -inf), the sink first, NaN as
    +inf (as the kernels rank), ties to the lower slot."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, width, generator=generator, dtype=torch.float64)
    if ties:
        scores = scores.round()
    if infinite:
        special = torch.tensor([float("-inf"), float("inf"), float("nan")], dtype=torch.float64)
        draw = torch.randint(0, 3, (rows, width), generator=generator)
        scores = torch.where(torch.rand(rows, width, generator=generator) < 0.4, special[draw], scores)
    selected = torch.randperm(2 * width, generator=generator)[:width].repeat(rows, 1)
    selected[torch.rand(rows, width, generator=generator) < 0.3] = -1
    chosen = attended_slots(scores, selected, count)
    for row in range(rows):
        held = [slot for slot in range(width) if selected[row, slot] >= 0]
        value = {slot: float(scores[row, slot]) for slot in held}
        key = {slot: float("inf") if selected[row, slot] == 0 or value[slot] != value[slot] else value[slot]
               for slot in held}
        best = sorted(held, key=lambda slot: (-key[slot], slot))[:count]
        assert chosen[row].nonzero().view(-1).tolist() == sorted(best)


def test_a_held_page_scoring_minus_infinity_is_attended_before_any_empty_slot() -> None:
    """Three held pages and K - 1 = 3: all three are attended, plus the tail, whatever their scores."""
    pool = PagePool(2, 4, torch.float64, torch.device("cpu"), capacity=8)
    pages = OffloadedPages(pool, 1, 1, 4, 2, standby_pages=2)
    pages.selected.copy_(torch.tensor([[-1, 0, 3, 4, -1]]))
    slots, lengths = pages.decode_pages(torch.tensor([2]), torch.tensor([[0.0, 5.0, 1.0, float("-inf"), 0.0]]))
    assert (slots[0, :4] - pages.base).tolist() == [1, 2, 3, 5]
    assert lengths[0].tolist() == [2, 2, 2, 2]


def test_each_step_attends_to_the_working_sets_best_pages_and_copies_nothing_between_reranks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every decode step lists, per stable row, the ``K - 1`` best of its ``K - 1 + C`` working-set pages by that
    step's scores (the sink always) and its tail; the attended pages change between reranks, while pages come from
    the host tier only at reranks (the promotion count moves only then)."""
    config = tiny_config(group=2, num_kv_heads=2, num_layers=2)
    model = tiny_model(config, seed=3)
    listings: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = []
    decode_pages = OffloadedPages.decode_pages

    def recording(self: OffloadedPages, last_page_len: torch.Tensor, scores: torch.Tensor | None = None,
                  row_pages: torch.Tensor | None = None):
        slots, lengths = decode_pages(self, last_page_len, scores, row_pages)
        listings.append((self.selected.clone(), scores.clone(), slots - self.base, int(self.counters.promoted_pages)))
        return slots, lengths

    monkeypatch.setattr(OffloadedPages, "decode_pages", recording)
    cache = checked(FlexiCache.from_model(model, profile=HeadProfile(2, 2, config.head_dim, []), token_budget=32,
                                          page_size=4, rerank_interval=8, standby_pages=3))
    greedy(model, random_prompt(96, seed=4).view(1, -1), cache, max_new_tokens=24)
    assert len(listings) == 2 * 23
    moved = 0
    for (selected, scores, slots, _), (_, _, next_slots, _) in zip(listings, listings[2:] + listings[-2:]):
        for row in range(selected.shape[0]):
            key = {slot: float("inf") if selected[row, slot] == 0 else float(scores[row, slot]) for slot in range(10)}
            best = sorted(sorted(range(10), key=lambda slot: (-key[slot], slot))[:7])
            assert (slots[row] - row * 11).tolist() == best + [10]  # slots in order, then the tail
        moved += not torch.equal(slots, next_slots)
    assert moved  # the attended pages follow the queries
    for layer in range(2):  # promotions only at the layer's reranks (steps 8 - layer, 16 - layer, ...)
        counts = [listing[3] for listing in listings[layer::2]]
        changed = [step for step in range(1, len(counts)) if counts[step] != counts[step - 1]]
        assert changed and all((step + 1 + layer) % 8 == 0 for step in changed), (layer, changed)


def test_the_device_holds_k_plus_c_pages_per_stable_row() -> None:
    config = tiny_config(group=2, num_kv_heads=2, num_layers=2)
    model = tiny_model(config, seed=5)
    ids = random_prompt(80, seed=6).view(1, -1)
    stats = {}
    for standby in (0, 2):
        cache = FlexiCache.from_model(model, profile=mixed_profile(config), token_budget=32, page_size=4,
                                      standby_pages=standby)
        greedy(model, ids, cache, max_new_tokens=6)
        stats[standby] = cache.stats()
    stable_rows = 2 * 2 - len(mixed_profile(config).unstable_heads)
    page_bytes = 2 * 4 * config.head_dim * 8  # K + V, float64
    assert stats[2]["device_kv_bytes"] - stats[0]["device_kv_bytes"] == stable_rows * 2 * page_bytes
    assert stats[2]["host_kv_bytes"] == stats[0]["host_kv_bytes"]


def test_standby_pages_keep_every_stored_page_exact_through_crops_and_reorders() -> None:
    config = tiny_config(group=2, num_kv_heads=2, num_layers=2, head_dim=4)
    cache = checked(FlexiCache(config, profile=HeadProfile(2, 2, 4, [(0, 1)]), token_budget=12, page_size=2,
                               rerank_interval=5, standby_pages=3, principal_bounds=False))
    driver = Driver(config, cache, seed=2)
    driver.prefill([21, 15])
    for _ in range(9):
        driver.decode()
        check_layer_state(driver, cache)
    driver.crop(5)
    check_layer_state(driver, cache, settled=False)
    driver.decode()
    check_layer_state(driver, cache)
    driver.repeat(2)
    driver.select(torch.tensor([3, 0, 1]))
    for _ in range(6):
        driver.decode()
        check_layer_state(driver, cache)


def test_a_covering_budget_with_standby_pages_generates_what_dynamic_cache_generates() -> None:
    config = tiny_config(group=2, num_kv_heads=2, num_layers=2)
    model = tiny_model(config, seed=7)
    ids = random_prompt(37, seed=8).view(1, -1)
    assert_same_generation(model, ids, None, 20, profile=mixed_profile(config), token_budget=64, page_size=8,
                           standby_pages=4, max_promotions=1)


def test_a_left_padded_batch_with_standby_pages_generates_what_each_request_generates_alone() -> None:
    config = tiny_config(group=2, num_kv_heads=2, num_layers=2)
    model = tiny_model(config, seed=9)
    assert_batch_matches_alone(model, [random_prompt(70, seed=10), random_prompt(45, seed=11)],
                               profile=mixed_profile(config), token_budget=24, page_size=4, rerank_interval=4,
                               standby_pages=3)


@pytest.mark.parametrize("bad", [-1, 1.5, "4", True, None])
def test_a_bad_standby_count_is_refused_with_what_to_pass(bad: object) -> None:
    with pytest.raises(ValueError, match="standby_pages"):
        FlexiCache(tiny_config(), standby_pages=bad)


def test_a_standby_count_past_the_working_set_limit_is_refused_with_the_limit() -> None:
    with pytest.raises(ValueError, match=f"0 to {MAX_WORKING_SET_SLOTS - 64} pages"):
        FlexiCacheConfig(token_budget=512, page_size=8, standby_pages=MAX_WORKING_SET_SLOTS)
    assert FlexiCacheConfig(token_budget=512, page_size=8, standby_pages=MAX_WORKING_SET_SLOTS - 64).num_standby_pages


def test_auto_and_quarter_follow_the_budget_through_a_replaced_config() -> None:
    config = FlexiCacheConfig(token_budget=2048, page_size=8)
    assert config.standby_pages == "auto" and config.num_standby_pages == 2048 // 8
    assert dataclasses.replace(config, token_budget=128).num_standby_pages == 128 // 8
    quarter = dataclasses.replace(config, standby_pages="quarter")
    assert quarter.num_standby_pages == 2048 // 8 // 4
    assert dataclasses.replace(quarter, token_budget=128).num_standby_pages == 128 // 8 // 4
    assert dataclasses.replace(config, standby_pages=3).num_standby_pages == 3


def test_auto_stays_within_the_working_set_slots() -> None:
    pages = MAX_WORKING_SET_SLOTS * 3 // 4
    assert FlexiCacheConfig(token_budget=pages * 8, page_size=8).num_standby_pages == MAX_WORKING_SET_SLOTS - pages
