"""RCO properties and the stable / unstable classification on synthetic top-K set sequences."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexicache.profiling.reports import cross_task_agreement, promoted_fraction, rco_curves
from flexicache.profiling.stability import (
    bottom_quantile_mask,
    classify_heads,
    lowest_count,
    overlap_counts,
    random_corrected_overlap,
    rco_by_distance,
    stability_score,
)


@st.composite
def two_sets(draw):
    n = draw(st.integers(3, 200))
    k = draw(st.integers(1, n - 1))
    a = draw(st.lists(st.integers(0, n - 1), min_size=k, max_size=k, unique=True))
    b = draw(st.lists(st.integers(0, n - 1), min_size=k, max_size=k, unique=True))
    return n, k, a, b


@settings(max_examples=200, deadline=None)
@given(two_sets())
def test_rco_matches_definition_bounds_and_symmetry(case):
    n, k, a, b = case
    ta, tb = torch.tensor(sorted(a)), torch.tensor(sorted(b))
    rco = float(random_corrected_overlap(ta, tb, k, n))
    expected = (len(set(a) & set(b)) / k - k / n) / (1 - k / n)
    assert rco == pytest.approx(expected, abs=1e-12)
    assert -k / (n - k) - 1e-12 <= rco <= 1 + 1e-12
    assert rco == pytest.approx(float(random_corrected_overlap(tb, ta, k, n)), abs=1e-12)
    assert float(random_corrected_overlap(ta, ta, k, n)) == pytest.approx(1.0)


@settings(max_examples=100, deadline=None)
@given(two_sets(), st.integers(0, 5))
def test_overlap_ignores_padding(case, pad):
    _, _, a, b = case
    padding = [-1] * pad
    ta, tb = torch.tensor(sorted(a) + padding), torch.tensor(sorted(b) + padding)
    assert int(overlap_counts(ta, tb)) == len(set(a) & set(b))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 30), max_size=12, unique=True), min_size=1, max_size=6),
       st.lists(st.integers(0, 30), max_size=9, unique=True), st.integers(0, 3))
def test_overlap_counts_sets_in_any_order_of_other_widths_against_one_broadcast_set(rows, other, pad):
    """Rows of ``a`` (unsorted, padded to a common width) against one set ``b`` of another width, broadcast."""
    width = max(len(row) for row in rows) + pad
    a = torch.tensor([row + [-1] * (width - len(row)) for row in rows], dtype=torch.long).view(len(rows), width)
    b = torch.tensor(other[::-1] + [-1] * pad, dtype=torch.long).view(1, len(other) + pad)
    assert overlap_counts(a, b).tolist() == [len(set(row) & set(other)) for row in rows]


def test_rco_is_zero_in_expectation_for_independent_random_sets():
    generator = torch.Generator().manual_seed(0)
    n, k, trials = 64, 16, 20000
    a = torch.rand(trials, n, generator=generator).argsort(dim=1)[:, :k]
    b = torch.rand(trials, n, generator=generator).argsort(dim=1)[:, :k]
    rco = random_corrected_overlap(a, b, k, n)
    # overlap is hypergeometric: var = k * (k/n) * ((n-k)/n) * ((n-k)/(n-1)); the mean of `trials` draws is tighter
    std = math.sqrt(k * (k / n) * ((n - k) / n) * ((n - k) / (n - 1))) / k / (1 - k / n) / math.sqrt(trials)
    assert abs(float(rco.mean())) < 4 * std
    assert float(rco.std()) > 0.1  # individual draws do vary


def test_rco_undefined_when_every_page_is_selected():
    pages = torch.tensor([0, 1, 2, 3])
    assert math.isnan(float(random_corrected_overlap(pages, pages, 4, 4)))
    assert math.isnan(float(random_corrected_overlap(pages, pages, 4, 3)))


def step_sets(seed: int, steps: int, heads: int, k: int, start_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[steps, heads, k]`` random page sets (ascending, ``-1`` padding where fewer pages exist) over a page count
    growing by one every second step from ``start_pages``, and that count ``[steps]``."""
    generator = torch.Generator().manual_seed(seed)
    num_pages = start_pages + torch.arange(steps) // 2
    pages = torch.full((steps, heads, k), -1, dtype=torch.long)
    for step, n in enumerate(num_pages.tolist()):
        chosen = torch.rand(heads, n, generator=generator).argsort(dim=1)[:, :k].sort(dim=1).values
        pages[step, :, : chosen.shape[1]] = chosen
    return pages, num_pages


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 40), st.integers(1, 6), st.integers(1, 20), st.integers(1, 12),
       st.sampled_from([1, 7, 2**24]))
def test_rco_by_distance_equals_the_mean_over_pairs_of_each_distance(seed, steps, k, max_distance, start, chunk):
    """Every valid pair at once (in chunks of any size) gives exactly the per-distance means of the pairs' RCO."""
    pages, num_pages = step_sets(seed, steps, 3, k, start)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("flexicache.profiling.stability.PAIR_CHUNK_ENTRIES", chunk)
        curve, pairs = rco_by_distance(pages, num_pages, k, max_distance)
    for d in range(1, max_distance + 1):
        valid = [t for t in range(steps - d) if num_pages[t] > k] if d < steps else []
        assert int(pairs[d - 1]) == len(valid)
        if not valid:
            assert torch.isnan(curve[d - 1]).all()
            continue
        expected = torch.stack([random_corrected_overlap(pages[t], pages[t + d], k, int(num_pages[t + d]))
                                for t in valid]).mean(dim=0)
        torch.testing.assert_close(curve[d - 1], expected, rtol=1e-12, atol=1e-12, equal_nan=True)


def test_rco_by_distance_skips_steps_without_enough_pages():
    k = 2
    # step t: pages {0, t+1}; num_pages grows 2, 3, 4, 5: the first step (N = K) has no defined RCO
    pages = torch.tensor([[0, 1], [0, 2], [0, 3], [0, 4]]).view(4, 1, 2)
    num_pages = torch.tensor([2, 3, 4, 5])
    curve, pairs = rco_by_distance(pages, num_pages, k, max_distance=3)
    assert pairs.tolist() == [2, 1, 0]
    # overlap 1 of 2 at every valid pair: (1/2 - 2/N) / (1 - 2/N) at N = 4, 5 (d=1) and N = 5 (d=2)

    def rco(n: int) -> float:
        return (0.5 - 2 / n) / (1 - 2 / n)

    assert float(curve[0, 0]) == pytest.approx((rco(4) + rco(5)) / 2)
    assert float(curve[1, 0]) == pytest.approx(rco(5))
    assert math.isnan(float(curve[2, 0]))


def test_stability_score_requires_data():
    with pytest.raises(ValueError, match="budget"):
        stability_score(torch.full((3, 2, 2), float("nan")))


def synthetic_trace(
    unstable: set[tuple[int, int]], layers: int, heads: int, steps: int, k: int, start_pages: int,
    generator: torch.Generator, churn: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K sets with the cache's layout (sink 0, tail forced, ascending). Stable head (l, h) swaps one page of
    its core set with probability ``churn[l, h]`` per step; unstable heads draw a fresh random set every step."""
    num_pages = torch.tensor([start_pages + (s + 1) // 16 for s in range(steps)])
    pages = torch.empty(steps, layers, heads, k, dtype=torch.int16)
    for layer in range(layers):
        for head in range(heads):
            core = (torch.randperm(start_pages - 2, generator=generator)[: k - 2] + 1).tolist()
            for step in range(steps):
                n = int(num_pages[step])
                if (layer, head) in unstable:
                    core = (torch.randperm(n - 2, generator=generator)[: k - 2] + 1).tolist()
                elif float(torch.rand(1, generator=generator)) < float(churn[layer, head]):
                    outside = [p for p in range(1, n - 1) if p not in core]
                    core[int(torch.randint(k - 2, (1,), generator=generator))] = outside[
                        int(torch.randint(len(outside), (1,), generator=generator))]
                pages[step, layer, head] = torch.tensor(sorted([0, *core, n - 1]))
    return pages, num_pages


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_classification_recovers_planted_unstable_heads(seed):
    generator = torch.Generator().manual_seed(seed)
    layers, heads, k = 4, 4, 8
    all_heads = [(layer, head) for layer in range(layers) for head in range(heads)]
    chosen = torch.randperm(len(all_heads), generator=generator)[:4].tolist()
    unstable = {all_heads[i] for i in chosen}
    churn = torch.rand(layers, heads, generator=generator) * 0.3  # stable heads differ in stability too
    traces = [synthetic_trace(unstable, layers, heads, 64, k, 40, generator, churn) for _ in range(5)]
    sample_scores = torch.stack([stability_score(rco_by_distance(p, n, k)[0]) for p, n in traces])
    result = classify_heads(sample_scores, fraction=0.25)
    assert set(result.unstable) == unstable
    mask = result.unstable_mask()
    curves = rco_curves(torch.stack([rco_by_distance(p, n, k)[0] for p, n in traces]), mask)
    assert all(s > u for s, u in zip(curves["stable_mean"], curves["unstable_mean"], strict=True))
    # unstable heads replace nearly the whole core at every rerank, stable ones only what churned
    promoted = promoted_fraction(traces, mask, k, interval=16)
    assert promoted["promoted"]["unstable"] > 0.6 > promoted["promoted"]["stable"]
    tasks = ["a", "a", "b", "b", "b"]
    agreement = cross_task_agreement(sample_scores, tasks, reference=result.unstable)
    assert agreement["mean"] == 1.0 and agreement["vs_all_samples"] == {"a": 1.0, "b": 1.0}


def test_classification_counts_bottom_quartile_membership_before_mean():
    # 8 heads (1 layer); per sample the bottom quartile is 2 heads.
    scores = torch.tensor([
        [0.10, 0.20, 0.90, 0.90, 0.90, 0.90, 0.90, -5.0],
        [0.10, 0.20, 0.90, 0.90, 0.90, 0.90, 0.90, 0.95],
        [0.10, 0.20, 0.90, 0.90, 0.90, 0.90, 0.90, 0.95],
    ]).view(3, 1, 8)
    result = classify_heads(scores, fraction=0.25)
    # head 7 has the lowest mean (one outlier sample) but is in the bottom quartile once; heads 0 and 1 always
    assert result.unstable == [(0, 0), (0, 1)]
    assert result.bottom_counts.flatten().tolist() == [3, 2, 0, 0, 0, 0, 0, 1]


def test_classification_breaks_count_ties_by_mean_score():
    scores = torch.tensor([[0.3, 0.1, 0.9, 0.9], [0.1, 0.3, 0.9, 0.9]]).view(2, 1, 4)
    # quartile of 4 heads = 1 head per sample: head 1 then head 0, both counted once; mean 0.2 each -> by position
    assert classify_heads(scores, fraction=0.25).unstable == [(0, 0)]
    scores[0, 0, 0] = 0.31  # head 0's mean now higher: head 1 wins the tie
    assert classify_heads(scores, fraction=0.25).unstable == [(0, 1)]


def test_bottom_quantile_mask_and_counts():
    scores = torch.arange(12.0).view(1, 3, 4)
    mask = bottom_quantile_mask(scores, 0.25)
    assert mask.flatten().tolist() == [True] * 3 + [False] * 9
    assert lowest_count(90, 0.25) == 23 and lowest_count(16, 0.25) == 4 and lowest_count(5, 0.0) == 0
    with pytest.raises(ValueError, match=r"fraction must be in \[0, 1\], got 1.5"):
        lowest_count(10, 1.5)


def test_promoted_fraction_by_hand():
    k = 4
    pages = torch.full((17, 1, 2, k), -1, dtype=torch.int16)
    pages[0, 0, 0] = torch.tensor([0, 1, 2, 9])
    pages[16, 0, 0] = torch.tensor([0, 2, 3, 10])  # 2 new: page 3 (old, from the host) and page 10 (new tail)
    pages[0, 0, 1] = torch.tensor([0, 4, 5, 9])
    pages[16, 0, 1] = torch.tensor([0, 4, 5, 10])  # only the tail is new
    num_pages = torch.tensor([10] * 16 + [11])
    unstable = torch.tensor([[True, False]])
    result = promoted_fraction([(pages, num_pages)], unstable, k, interval=16)
    assert result["reranks"] == 1
    assert result["promoted"] == {"stable": 0.25, "unstable": 0.5, "all": 0.375}
    assert result["promoted_old_pages"] == {"stable": 0.0, "unstable": 0.25, "all": 0.125}


def test_cross_task_agreement_detects_disagreement():
    # task a: heads 0, 1 least stable; task b: heads 2, 3 (8 heads, 25% = 2)
    a = torch.tensor([0.1, 0.2, 0.8, 0.8, 0.9, 0.9, 0.9, 0.9])
    b = torch.tensor([0.8, 0.8, 0.1, 0.2, 0.9, 0.9, 0.9, 0.9])
    scores = torch.stack([a, a, b]).view(3, 1, 8)
    result = cross_task_agreement(scores, ["a", "a", "b"])
    assert result["matrix"] == [[1.0, 0.0], [0.0, 1.0]] and result["mean"] == 0.0
    assert result["random_baseline"] == 0.25 and result["samples"] == {"a": 2, "b": 1}
