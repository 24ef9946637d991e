"""What a head gains from being unstable (flexicache.profiling.staleness, the online split's default score): zero for
a head whose attention stays on one page, large for one whose attention moves to another page at every step, nan for
a prompt whose pages all fit the budget, a split that makes the moving heads unstable, and the setting's checks."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

from flexicache import FlexiCache, HeadProfile
from flexicache.config import FlexiCacheConfig
from flexicache.evaluation.methods import FlexiCacheMethod
from flexicache.head_split import request_stability, unstable_heads_by_score
from flexicache.profiling.staleness import prompt_staleness_gain

PAGE, LENGTH, WINDOW, DIM = 2, 64, 16, 64  # 32 pages of 2 tokens; the last 16 positions are the tail


def one_hot_prompt(targets: list[list[int]], also: list[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """``(query [1, H, W, D], key [1, H, T, D])``: page ``j``'s keys are ``8 e_j``; head ``h``'s tail query ``w`` is
    ``8 e_{targets[h][w]}``, so nearly all its attention (logit 8 against 0) sits on that page, plus ``0.5 e_j`` for
    the pages ``also`` (box scores above the other pages', a negligible share of the attention)."""
    key = torch.zeros(LENGTH, DIM)
    key[torch.arange(LENGTH), torch.arange(LENGTH) // PAGE] = 8.0
    query = torch.zeros(len(targets), WINDOW, DIM)
    query[:, :, list(also)] = 0.5
    for head, pages in enumerate(targets):
        query[head, torch.arange(WINDOW), torch.tensor(pages)] = 8.0
    return query.unsqueeze(0), key.expand(len(targets), -1, -1).unsqueeze(0)


def gain(query: torch.Tensor, key: torch.Tensor, pages_per_head: int = 3, standby: int = 0) -> torch.Tensor:
    return prompt_staleness_gain(query, key, pages_per_head, standby, 3 * pages_per_head, PAGE, horizon=4)


def test_a_head_on_one_page_gains_nothing_and_a_head_moving_every_step_gains_the_mass_it_moves() -> None:
    fixed = [5] * WINDOW
    moving = [2 + w for w in range(WINDOW)]  # a new page at every step, each full at its step
    query, key = one_hot_prompt([fixed, moving])
    fixed_gain, moving_gain = gain(query, key)[0].tolist()
    assert abs(fixed_gain) < 1e-6
    # every step but the rerank's own misses its page as a stable head (3 of 4 over a horizon of 4): ~0.99 each
    assert 0.7 < moving_gain < 0.75


def test_standby_pages_that_hold_the_next_pages_remove_the_staleness() -> None:
    """A head cycling over four pages: with ``K - 1 + C`` pages on the device holding all four (their box scores
    rank next to the current one's), nothing is lost."""
    moving = [2 + w % 4 for w in range(WINDOW)]
    query, key = one_hot_prompt([moving], also=[2, 3, 4, 5])
    assert float(gain(query, key)[0, 0]) > 0.3
    assert abs(float(gain(query, key, standby=8)[0, 0])) < 1e-6


def test_a_prompt_whose_full_pages_all_fit_the_budget_cannot_tell() -> None:
    query, key = one_hot_prompt([[5] * WINDOW])
    assert torch.isnan(gain(query, key, pages_per_head=32)).all()  # 31 full pages at most, K - 1 = 31


def test_the_split_makes_the_heads_whose_attention_moves_unstable() -> None:
    """Four KV heads of one layer, two moving: the quarter plus the default profile's floor picks the moving ones."""
    settings = FlexiCacheConfig(token_budget=6, page_size=PAGE, standby_pages=0, rerank_interval=4)
    fixed, moving = [5] * WINDOW, [2 + w for w in range(WINDOW)]
    query, key = one_hot_prompt([fixed, moving, [7] * WINDOW, [20 - w for w in range(WINDOW)]])
    scores = request_stability(query, key, None, settings)[0]  # the queries of the last 16 positions
    assert unstable_heads_by_score([scores], [[]], 0.5) == [[1, 3]]


def test_the_setting_is_checked_and_belongs_to_the_online_split() -> None:
    with pytest.raises(ValueError, match="split_score must be 'staleness'"):
        FlexiCacheConfig(split_score="rco")
    config = tiny_config()
    with pytest.raises(ValueError, match="split_score='overlap' sets how the online head split"):
        FlexiCache(config, profile=HeadProfile.default(config), split_score="overlap")
    assert FlexiCache(config, split_score="overlap").settings.split_score == "overlap"


def test_an_eval_row_with_a_profile_leaves_the_split_score_out() -> None:
    options = {"token_budget": 64, "split_score": "staleness"}
    assert "split_score" not in FlexiCacheMethod(None, options, "default", None).cache_options
    assert FlexiCacheMethod(None, options, "online", "online").settings["split_score"] == "staleness"
    assert "split_score" not in FlexiCacheMethod(None, {**options, "split_score": "overlap"}, "online").settings
