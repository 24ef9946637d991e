"""``standby_pages``: between two reranks, every decode step refreshes each stable row among its selected pages and
its standby pages (the best pages outside the selection at its last rerank). The refresh rule against a brute-force
reference; the invariants still hold (covering budget == DynamicCache, left-padded batch == alone, stored pages
exact); bad values are refused."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    assert_batch_matches_alone,
    Driver,
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
from flexicache.offload import OffloadedPages
from flexicache.selection import standby_after


def reference_standby(scores: list[float], num_full: int, selected: set[int], count: int) -> list[int]:
    """The ``count`` best finite-scored full pages outside ``selected`` (ties to the lower page), ascending."""
    outside = [p for p in range(num_full) if p not in selected and scores[p] != float("-inf")]
    best = sorted(outside, key=lambda p: (-scores[p], p))[:count]
    return sorted(best) + [-1] * (count - len(best))


@given(st.integers(1, 4), st.integers(1, 12), st.integers(0, 5), st.integers(0, 2**31 - 1), st.booleans())
def test_standby_pages_are_the_best_pages_outside_the_selection(rows, width, count, seed, ties):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, width, generator=generator, dtype=torch.float64)
    if ties:  # equal scores, and pages no rerank may take
        scores = scores.round()
        scores[torch.rand(rows, width, generator=generator) < 0.2] = float("-inf")
    num_full = torch.randint(0, width + 1, (rows,), generator=generator)
    slots = 3
    selected = torch.full((rows, slots), -1, dtype=torch.long)
    for row in range(rows):
        held = torch.randperm(width, generator=generator)[:slots]
        held = held[held < num_full[row]]
        selected[row, :held.numel()] = held
    standby = standby_after(scores, num_full, selected, count)
    assert standby.shape == (rows, count)
    for row in range(rows):
        held = {p for p in selected[row].tolist() if p >= 0}
        assert standby[row].tolist() == reference_standby(scores[row].tolist(), int(num_full[row]), held, count)


def spy_on_refreshes(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, torch.Tensor]]:
    """Record every refresh: the pages it read, their scores and the state it left."""
    records: list[dict[str, torch.Tensor]] = []
    refresh = OffloadedPages.refresh

    def recording_refresh(self: OffloadedPages, entry_scores: torch.Tensor, num_full: torch.Tensor, width: int,
                          max_promotions: int | None = None) -> None:
        listed = self.listed_pages().clone()
        refresh(self, entry_scores, num_full, width, max_promotions)
        records.append({"listed": listed, "scores": entry_scores.clone(), "selected": self.selected.clone(),
                        "standby": self.standby.clone()})

    monkeypatch.setattr(OffloadedPages, "refresh", recording_refresh)
    return records


def test_a_refresh_takes_the_best_listed_pages_and_puts_the_rest_on_standby(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every refresh of every stable row selects the top ``K - 1`` of the pages it held or kept on standby by the
    step's scores (sink forced, ties to the lower page), never another page, and the rest become its standby; a
    refresh does change selections (the queries move between reranks)."""
    config = tiny_config(group=2, num_kv_heads=2, num_layers=2)
    model = tiny_model(config, seed=3)
    records = spy_on_refreshes(monkeypatch)
    cache = checked(FlexiCache.from_model(model, profile=HeadProfile(2, 2, config.head_dim, []), token_budget=32,
                                          page_size=4, rerank_interval=8, standby_pages=3))
    greedy(model, random_prompt(96, seed=4).view(1, -1), cache, max_new_tokens=24)
    assert len(records) == 2 * 23
    changed = 0
    for record in records:
        for row in range(record["listed"].shape[0]):
            listed = [p for p in record["listed"][row].tolist() if p >= 0]
            scores = {p: (float("inf") if p == 0 else s)
                      for p, s in zip(record["listed"][row].tolist(), record["scores"][row].tolist()) if p >= 0}
            best = sorted(listed, key=lambda p: (-scores[p], p))
            selected = sorted(p for p in record["selected"][row].tolist() if p >= 0)
            assert selected == sorted(best[:7])
            assert record["standby"][row].tolist() == sorted(best[7:]) + [-1] * (3 - len(best[7:]))
            changed += selected != sorted(p for p in record["listed"][row, :7].tolist() if p >= 0)
    assert changed


def test_a_refresh_with_a_limit_swaps_at_most_that_many_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    config = tiny_config(group=2, num_kv_heads=2, num_layers=2)
    model = tiny_model(config, seed=5)
    records = spy_on_refreshes(monkeypatch)
    cache = checked(FlexiCache.from_model(model, profile=HeadProfile(2, 2, config.head_dim, []), token_budget=32,
                                          page_size=4, rerank_interval=8, standby_pages=4, max_promotions=1))
    greedy(model, random_prompt(96, seed=6).view(1, -1), cache, max_new_tokens=24)
    for record in records:
        for before, after in zip(record["listed"][:, :7], record["selected"]):
            assert len(set(after.tolist()) - set(before.tolist())) <= 1


def test_standby_pages_keep_every_stored_page_exact_through_crops_and_reorders() -> None:
    """Refreshes, crops, request selection and repetition leave every stable slot holding exactly the page its
    selection names, standby pages that are full pages outside the selection, and the sink selected."""
    config = tiny_config(group=2, num_kv_heads=2, num_layers=2, head_dim=4)
    cache = checked(FlexiCache(config, profile=HeadProfile(2, 2, 4, [(0, 1)]), token_budget=12, page_size=2,
                               rerank_interval=5, standby_pages=3, principal_bounds=False))
    driver = Driver(config, cache, seed=2)

    def check(settled: bool = True) -> None:
        check_layer_state(driver, cache, settled)
        for layer in cache.layers:
            off = layer.storage.offloaded
            for selected, standby in zip(off.selected.tolist(), off.standby.tolist()):
                listed = [p for p in standby if p >= 0]
                assert listed == sorted(listed) and not set(listed) & set(selected)

    driver.prefill([21, 15])
    for _ in range(9):
        driver.decode()
        check()
    driver.crop(5)
    check(settled=False)
    driver.decode()
    check()
    standby = [layer.storage.offloaded.standby.clone() for layer in cache.layers]
    driver.repeat(2)
    driver.select(torch.tensor([3, 0, 1]))
    for layer, before in zip(cache.layers, standby):  # the rows of requests 1, 0, 0
        heads = len(layer.stable_heads)
        assert torch.equal(layer.storage.offloaded.standby, before.view(2, heads, -1)[[1, 0, 0]].flatten(0, 1))
    for _ in range(6):
        driver.decode()
        check()


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
                               profile=mixed_profile(config), token_budget=24, page_size=4, rerank_interval=4, standby_pages=3)


@pytest.mark.parametrize("bad", [-1, 1.5, "4", True, None])
def test_a_bad_standby_count_is_refused_with_what_to_pass(bad: object) -> None:
    with pytest.raises(ValueError, match="standby_pages"):
        FlexiCache(tiny_config(), standby_pages=bad)
