"""``max_promotions``: a stable head's decode rerank takes in at most that many new pages (the best newcomers for its
worst held pages), its prompt rerank is not limited; the invariants still hold (covering budget == DynamicCache,
left-padded batch == alone); bad values are refused. The selection rule itself: tests/test_selection.py."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    assert_batch_matches_alone,
    assert_same_generation,
    checked,
    greedy,
    mixed_profile,
    random_prompt,
    tiny_config,
    tiny_model,
)

from flexicache import FlexiCache, HeadProfile
from flexicache.offload import OffloadedPages


def test_a_decode_rerank_promotes_at_most_max_promotions_pages_per_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every decode rerank of every stable row changes at most ``max_promotions`` of its held pages, the prompt's
    rerank fills the whole selection; with the limit fewer pages move than without it, and fewer bytes."""
    config = tiny_config(group=2, num_kv_heads=2, num_layers=2)
    model = tiny_model(config, seed=3)
    all_stable = HeadProfile(2, 2, config.head_dim, [])
    ids = random_prompt(96, seed=4).view(1, -1)
    changed: list[tuple[int | None, int, int]] = []  # (limit, most pages a row swapped, empty slots before)
    rerank = OffloadedPages.rerank

    def recording_rerank(self: OffloadedPages, scores: torch.Tensor, num_full: torch.Tensor,
                         max_promotions: int | None = None) -> None:
        before = self.selected.clone()
        rerank(self, scores, num_full, max_promotions)
        swapped = max(len(set(after.tolist()) - set(held.tolist())) for held, after in zip(before, self.selected))
        changed.append((max_promotions, swapped, int((before < 0).sum())))

    monkeypatch.setattr(OffloadedPages, "rerank", recording_rerank)
    stats = {}
    for limit in (None, 1):
        cache = checked(FlexiCache.from_model(model, profile=all_stable, token_budget=32, page_size=4,
                                              rerank_interval=1, max_promotions=limit, standby_pages=0))
        greedy(model, ids, cache, max_new_tokens=24)
        stats[limit] = cache.stats()
    prompt, decode = [c for c in changed if c[0] is None and c[2]], [c for c in changed if c[0] == 1]
    assert prompt and all(swapped == 7 for _, swapped, _ in prompt)  # 7 selection slots, filled at once
    assert len(decode) == 2 * 23 and all(swapped <= 1 for _, swapped, empty in decode if not empty)
    assert any(swapped == 1 for _, swapped, _ in decode)
    assert max(swapped for limit, swapped, empty in changed if limit is None and not empty) > 1
    assert stats[1]["promoted_pages"] < stats[None]["promoted_pages"]
    assert stats[1]["bytes_h2d"] < stats[None]["bytes_h2d"]


def test_a_limit_of_a_whole_selection_changes_nothing() -> None:
    config = tiny_config(group=2, num_kv_heads=2, num_layers=3)
    model = tiny_model(config, seed=5)
    ids = random_prompt(80, seed=6).view(1, -1)
    outputs = []
    for limit in (None, 15, 100):  # 15: the stable heads' working set, K - 1 + C = 7 + 8 (standby_pages="auto")
        cache = checked(FlexiCache.from_model(model, profile=mixed_profile(config), token_budget=32, page_size=4,
                                              rerank_interval=2, max_promotions=limit))
        outputs.append((greedy(model, ids, cache, max_new_tokens=16), cache.stats()["promoted_pages"]))
    assert all(torch.equal(out, outputs[0][0]) and promoted == outputs[0][1] for out, promoted in outputs)


def test_a_covering_budget_with_a_limit_generates_what_dynamic_cache_generates() -> None:
    config = tiny_config(group=2, num_kv_heads=2, num_layers=2)
    model = tiny_model(config, seed=7)
    ids = random_prompt(37, seed=8).view(1, -1)
    assert_same_generation(model, ids, None, 20, profile=mixed_profile(config), token_budget=64,
                                        page_size=8, rerank_interval=1, max_promotions=1)


def test_a_left_padded_batch_with_a_limit_generates_what_each_request_generates_alone() -> None:
    config = tiny_config(group=2, num_kv_heads=2, num_layers=2)
    model = tiny_model(config, seed=9)
    assert_batch_matches_alone(model, [random_prompt(70, seed=10), random_prompt(45, seed=11)],
                               profile=mixed_profile(config), token_budget=24, page_size=4, rerank_interval=1, max_promotions=1)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "4", True])
def test_a_bad_limit_is_refused_with_what_to_pass(bad: object) -> None:
    with pytest.raises(ValueError, match="max_promotions"):
        FlexiCache(tiny_config(), max_promotions=bad)
