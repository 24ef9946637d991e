"""Prefill-time stability estimate from the prompt tail, and its agreement with an offline profile."""

from __future__ import annotations

import math

import pytest
import torch

from flexicache.profile import HeadProfile
from flexicache.profiling.online import (
    estimate_unstable_heads_from_prompt,
    online_agreement,
    prompt_page_sets,
    prompt_stability,
)


def _layer(stable_head: int, generator: torch.Generator, length: int = 256, window: int = 48):
    """Keys of 2 KV heads (GQA group 2); the stable head's tail queries all point the same way, the other's vary."""
    keys = torch.randn(1, 2, length, 8, generator=generator)
    query = torch.randn(1, 4, window, 8, generator=generator)
    fixed = torch.randn(8, generator=generator)
    query[0, 2 * stable_head : 2 * stable_head + 2] = fixed
    return query, keys


def test_prompt_page_sets_respect_causality():
    generator = torch.Generator().manual_seed(0)
    query, keys = _layer(0, generator, length=100, window=40)
    pages, counts = prompt_page_sets(query, keys, token_budget=48, page_size=16)
    positions = torch.arange(60, 100)
    assert counts.tolist() == (positions // 16 + 1).tolist()
    assert pages.shape == (40, 1, 2, 3)
    assert (pages.amax(dim=-1) == counts.view(-1, 1, 1) - 1).all()  # tail is each position's own page
    assert (pages[..., 0] == 0).all()


def test_estimate_finds_the_varying_heads():
    generator = torch.Generator().manual_seed(1)
    layers = [_layer(0, generator), _layer(1, generator)]
    estimate = estimate_unstable_heads_from_prompt(
        [q for q, _ in layers], [k for _, k in layers], token_budget=64, page_size=16, fraction=0.5
    )
    assert estimate.scores.shape == (2, 1, 2)
    # the fixed heads change only when the tail moves to a new page; the varying ones far more often
    assert float(estimate.scores[0, 0, 0]) > 0.8 and float(estimate.scores[1, 0, 1]) > 0.8
    assert float(estimate.scores[0, 0, 1]) < 0.6 and float(estimate.scores[1, 0, 0]) < 0.6
    assert estimate.unstable[:, 0].tolist() == [[False, True], [True, False]]


def test_estimate_is_nan_when_the_prompt_fits_the_budget():
    generator = torch.Generator().manual_seed(2)
    query, keys = _layer(0, generator, length=64, window=16)
    assert torch.isnan(prompt_stability(query, keys, token_budget=128)).all()


def test_online_agreement_counts_overlap_and_rank_correlation():
    scores = [[0.9, 0.1], [0.8, 0.2], [0.7, 0.6]]
    profile = HeadProfile(num_layers=3, num_kv_heads=2, head_dim=8, unstable_heads=[(0, 1), (1, 1)], scores=scores)
    same = torch.tensor(scores).unsqueeze(0).repeat(2, 1, 1)
    result = online_agreement(same, profile)
    assert result["per_request_overlap"] == 1.0 and result["mean_estimate_overlap"] == 1.0
    assert result["spearman_vs_profile_scores"] == pytest.approx(1.0)
    assert result["random_baseline"] == pytest.approx(2 / 6)
    reversed_scores = -same
    result = online_agreement(reversed_scores, profile)
    assert result["mean_estimate_overlap"] == 0.0
    assert result["spearman_vs_profile_scores"] == pytest.approx(-1.0)
    half = same.clone()
    half[1, 0, 1] = 5.0  # request 1's two lowest are now (1, 1) and (2, 1): half of the profile's set
    assert online_agreement(half, profile)["per_request_overlap"] == pytest.approx((1.0 + 0.5) / 2)
    with pytest.raises(ValueError, match="shape"):
        online_agreement(torch.zeros(1, 2, 2), profile)


def test_estimate_matches_rco_definition_for_a_hand_made_case():
    # one KV head, one query head; the queries alternate between two directions that pick disjoint pages
    keys = torch.zeros(1, 1, 160, 2)
    keys[0, 0, 16:32, 0] = 1.0  # page 1 answers direction x
    keys[0, 0, 48:64, 1] = 1.0  # page 3 answers direction y
    query = torch.zeros(1, 1, 4, 2)
    query[0, 0, 0::2, 0] = 1.0
    query[0, 0, 1::2, 1] = 1.0
    # K = 3 (sink, tail and one chosen page), N = 10 at every tail position (144..159 -> page 9)
    score = float(prompt_stability(query, keys, token_budget=48, page_size=16, max_distance=3)[0, 0])
    k, n = 3, 10

    def rco(overlap: int) -> float:
        return (overlap / k - k / n) / (1 - k / n)

    expected = (rco(2) + rco(3) + rco(2)) / 3  # d = 1: 2 shared (sink, tail); d = 2: all 3; d = 3: 2
    assert score == pytest.approx(expected)
    assert not math.isnan(score)
