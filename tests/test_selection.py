"""Quest page scores and top-K page selection (``flexicache.selection``) against brute-force references."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import brute_quest, reference_topk
from hypothesis import given
from hypothesis import strategies as st

from flexicache.selection import limit_promotions, quest_page_scores, select_pages, update_selection


@st.composite
def quest_inputs(draw):
    rows, group = draw(st.integers(1, 4)), draw(st.integers(1, 7))
    pages, dim = draw(st.integers(1, 6)), draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(rows, group, dim, generator=generator, dtype=torch.float64)
    a = torch.randn(rows, pages, dim, generator=generator, dtype=torch.float64)
    b = torch.randn(rows, pages, dim, generator=generator, dtype=torch.float64)
    if draw(st.booleans()):  # exact zeros in the query (the relu/min split must handle them)
        query = query.masked_fill(torch.rand(query.shape, generator=generator) < 0.3, 0.0)
    return query, torch.minimum(a, b), torch.maximum(a, b)


@given(quest_inputs(), st.sampled_from(["max", "sum"]), st.sampled_from([1.0, 0.5, 0.0, 0.3]))
def test_quest_scores_match_brute_force(inputs, reduce, spread):
    query, kmin, kmax = inputs
    scores = quest_page_scores(query, kmin, kmax, reduce, spread)
    assert scores.shape == kmin.shape[:2] and scores.dtype == torch.float64
    for row in range(query.shape[0]):
        expected = brute_quest(query[row], kmin[row], kmax[row], reduce, spread)
        torch.testing.assert_close(scores[row], expected, rtol=1e-12, atol=1e-12)


def test_spread_weight_moves_the_score_from_the_bound_to_the_box_centre():
    generator = torch.Generator().manual_seed(4)
    query = torch.randn(3, 2, 8, generator=generator, dtype=torch.float64)
    keys = torch.randn(3, 5, 4, 8, generator=generator, dtype=torch.float64)  # [R, P, ps, D]
    kmin, kmax = keys.amin(2), keys.amax(2)
    bound = quest_page_scores(query, kmin, kmax, "sum", 1.0)
    centre = torch.einsum("rgd,rpd->rp", query, (kmin + kmax) / 2)
    torch.testing.assert_close(quest_page_scores(query, kmin, kmax, "sum", 0.0), centre)
    torch.testing.assert_close(quest_page_scores(query, kmin, kmax, "sum", 0.5), (bound + centre) / 2)
    assert bool((bound >= quest_page_scores(query, kmin, kmax, "sum", 0.5)).all())


def test_quest_score_is_an_upper_bound_of_every_key_in_the_page():
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(5, 3, 16, generator=generator, dtype=torch.float64)
    keys = torch.randn(5, 4, 8, 16, generator=generator, dtype=torch.float64)  # [R, P, ps, D]
    scores = quest_page_scores(query, keys.amin(2), keys.amax(2), "max")
    exact = torch.einsum("rgd,rpsd->rgps", query, keys).amax(dim=(1, 3))  # best q.k of the page over the group
    assert bool((scores >= exact - 1e-12).all())
    single = keys[:, :, :1]  # one-token pages: the bound is exact
    torch.testing.assert_close(quest_page_scores(query, single.amin(2), single.amax(2)),
                               torch.einsum("rgd,rpd->rgp", query, single[:, :, 0]).amax(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quest_scores_low_precision_inputs_give_float32(dtype):
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 2, 8, generator=generator).to(dtype)
    keys = torch.randn(2, 3, 4, 8, generator=generator).to(dtype)
    scores = quest_page_scores(query, keys.amin(2), keys.amax(2), "sum")
    assert scores.dtype == torch.float32
    expected = torch.stack([brute_quest(query[r].double(), keys[r].amin(1).double(), keys[r].amax(1).double(), "sum")
                            for r in range(2)]).float()
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-4)


def test_quest_scores_reject_unknown_reduce():
    with pytest.raises(ValueError, match="group_reduce"):
        quest_page_scores(torch.zeros(1, 1, 2), torch.zeros(1, 1, 2), torch.zeros(1, 1, 2), "mean")


# ------------------------------------------------------------------------------------------------ select_pages


@st.composite
def selection_inputs(draw):
    rows = draw(st.integers(1, 6))
    width = draw(st.integers(0, 24))
    k = draw(st.integers(2, 12))
    num_pages = [draw(st.integers(0, width)) for _ in range(rows)]
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    # Distinct scores (a permutation) so "the top scores" is well defined; the garbage beyond num_pages
    # (NaN / +inf, as unwritten page metadata produces) must be ignored.
    scores = torch.stack([torch.randperm(max(width, 1), generator=generator)[:width] for _ in range(rows)]).double()
    scores = scores.view(rows, width) - width / 2
    garbage = draw(st.sampled_from([float("nan"), float("inf"), 1e9]))
    for row, n in enumerate(num_pages):
        scores[row, n:] = garbage
    return scores, torch.tensor(num_pages), k


@given(selection_inputs(), st.booleans())
def test_select_pages_properties(inputs, force_last):
    scores, num_pages, k = inputs
    pages, page_scores = select_pages(scores, num_pages, k, force_last=force_last)
    width = scores.shape[1]
    assert pages.shape == page_scores.shape == (scores.shape[0], min(k, width))
    assert pages.dtype == torch.long
    for row in range(scores.shape[0]):
        n = int(num_pages[row])
        chosen = [int(p) for p in pages[row] if p >= 0]
        padding = pages[row][len(chosen):]
        assert bool((pages[row][: len(chosen)] >= 0).all()) and bool((padding == -1).all()), "padding only at the end"
        assert len(chosen) == min(k, n), "K entries, fewer only when fewer candidates"
        assert chosen == sorted(set(chosen)), "ascending, distinct"
        assert all(0 <= p < n for p in chosen), "only candidate pages"
        if n:
            assert 0 in chosen, "sink forced"
            if force_last:
                assert n - 1 in chosen, "tail forced"
        assert chosen == reference_topk(scores[row], n, k, force_last)
        forced = {0, n - 1} if force_last else {0}
        for col, page in enumerate(pages[row].tolist()):
            value = float(page_scores[row, col])
            if page < 0:
                assert value == -math.inf
            elif page in forced:
                assert value == math.inf
            else:
                assert value == float(scores[row, page])


def test_select_pages_exact_case():
    scores = torch.tensor([[0.0, 5.0, 1.0, 7.0, 3.0, 9.0, -2.0],
                           [4.0, 3.0, 2.0, 1.0, 0.0, 0.0, 0.0]])
    pages, _ = select_pages(scores, torch.tensor([7, 3]), 4, force_last=True)
    # row 0: sink 0, tail 6, then the two best of pages 1..5 -> 5 (9.0) and 3 (7.0)
    assert pages.tolist() == [[0, 3, 5, 6], [0, 1, 2, -1]]
    pages, _ = select_pages(scores, torch.tensor([7, 3]), 4, force_last=False)
    assert pages.tolist() == [[0, 1, 3, 5], [0, 1, 2, -1]]


@given(st.integers(1, 30), st.integers(0, 20), st.integers(2, 10), st.booleans(), st.integers(0, 2**31 - 1))
def test_select_pages_ties_are_batch_invariant(num_pages, extra_width, k, force_last, seed):
    """Equal scores (e.g. a zero query: every page scores 0) pick the lowest pages, whatever the row width: a
    request in a batch (wider rows, padded with garbage) selects the same pages as alone."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 3, (1, num_pages), generator=generator).double()  # many ties
    alone, _ = select_pages(scores, torch.tensor([num_pages]), k, force_last=force_last)
    wide = torch.cat([scores, torch.full((1, extra_width), float("nan"))], dim=1)
    batch = torch.cat([wide, torch.randn(2, num_pages + extra_width, generator=generator).double()])
    in_batch, _ = select_pages(batch, torch.tensor([num_pages, num_pages + extra_width, 1]), k,
                               force_last=force_last)
    chosen = [p for p in in_batch[0].tolist() if p >= 0]
    assert chosen == [p for p in alone[0].tolist() if p >= 0]
    assert chosen == reference_topk(scores[0], num_pages, k, force_last)  # lowest index first among ties


def test_select_pages_zero_query_picks_lowest_pages():
    scores = torch.zeros(2, 12)
    pages, _ = select_pages(scores, torch.tensor([12, 9]), 4, force_last=True)
    assert pages.tolist() == [[0, 1, 2, 11], [0, 1, 2, 8]]


# ------------------------------------------------------------------------------------ update_selection's limit


def reference_limited_selection(scores: torch.Tensor, num_full: int, held: list[int], slots: int,
                                limit: int) -> list[int]:
    """One row's limited rerank by hand: empty slots take the best newcomers, then the best remaining newcomer
    replaces the worst held page while it scores higher, at most ``limit`` times (the sink counts as +inf)."""
    value = {p: (math.inf if p == 0 else float(scores[p])) for p in range(num_full)}
    held = [p for p in held if p < num_full]
    newcomers = sorted((p for p in range(num_full) if p not in held), key=lambda p: (-value[p], p))
    chosen = held + newcomers[: slots - len(held)]
    newcomers = newcomers[slots - len(held):]
    for _ in range(limit):
        if not newcomers:
            break
        worst = min(chosen, key=lambda p: (value[p], -p))
        if value[newcomers[0]] <= value[worst]:
            break
        chosen.remove(worst)
        chosen.append(newcomers.pop(0))
    return sorted(chosen)


@given(selection_inputs(), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_a_limited_rerank_swaps_at_most_max_promotions_pages_for_better_ones(inputs, limit, seed):
    """With ``max_promotions`` a rerank keeps its held pages but for at most that many, each replaced by a better
    newcomer (the best newcomers, the worst held pages), fills empty slots without limit, and never selects a page
    beyond a row's full pages; a limit of a whole selection is no limit."""
    scores, num_full, slots = inputs
    generator = torch.Generator().manual_seed(seed)
    held = torch.full((scores.shape[0], slots), -1, dtype=torch.long)
    for row, n in enumerate(num_full.tolist()):
        count = int(torch.randint(0, min(slots, n) + 1, (), generator=generator)) if n else 0
        held[row, :count] = torch.randperm(n, generator=generator)[:count]
    _, promoted, _, updated = update_selection(scores, num_full, held, limit)
    for row, n in enumerate(num_full.tolist()):
        got = sorted(p for p in updated[row].tolist() if p >= 0)
        before = [p for p in held[row].tolist() if p >= 0]
        assert got == reference_limited_selection(scores[row], n, before, slots, limit)
        kept = set(before) & set(got)
        assert set(updated[row].tolist()) >= kept and all(updated[row, j] == p for j, p in enumerate(held[row].tolist())
                                                           if p in kept), "held pages keep their slots"
        assert int(promoted[row].sum()) == len(set(got) - set(before)) <= limit + slots - len(before)
    unlimited = update_selection(scores, num_full, held)
    assert all(torch.equal(a, b) for a, b in zip(update_selection(scores, num_full, held, slots), unlimited))


def test_limit_promotions_exact_case():
    """Row 0 holds pages 0, 1, 2 (scores sink, 1, 5); newcomers 3 (9), 4 (7), 5 (0): one promotion swaps page 1
    for page 3. Row 1 holds only the sink: its two empty slots take its two best newcomers, and the third best
    (page 2) stays a candidate for the one swap, which it loses."""
    scores = torch.tensor([[0.0, 1.0, 5.0, 9.0, 7.0, 0.0],
                           [0.0, 1.0, 5.0, 9.0, 7.0, 0.0]])
    held = torch.tensor([[0, 1, 2], [0, -1, -1]])
    limited = limit_promotions(scores, torch.tensor([6, 6]), held, 1)
    assert torch.isinf(limited).tolist() == [[False, False, False, False, True, True],
                                             [False, True, False, False, False, True]]
    _, _, _, updated = update_selection(scores, torch.tensor([6, 6]), held, 1)
    assert updated.tolist() == [[0, 3, 2], [0, 3, 4]]
