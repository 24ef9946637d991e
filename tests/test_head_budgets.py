"""``head_budgets="prompt"``: each request's ``H * K`` pages of a layer split across its KV heads at the prompt.

The split against a brute-force optimum, the prompt's page gains on hand-built attention, the per-row selection
against the same rule with one ``k`` per row, and the cache's invariants with the option on: decode attention equals
dense attention over the listed pages (fp64), a covering budget equals DynamicCache, a left-padded batch decodes as
each request alone, each row lists ``min(K_r, pages)`` pages (the backend contract), requests keep their split through
``batch_select_indices``; bad values refused.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import (
    Driver,
    assert_batch_matches_alone,
    assert_same_generation,
    checked,
    expected_decode,
    left_pad,
    random_prompt,
    tiny_config,
    tiny_model,
)
from hypothesis import given
from hypothesis import strategies as st

from flexicache import FlexiCache, HeadProfile
from flexicache.config import FlexiCacheConfig
from flexicache.head_budgets import prompt_page_gains, prompt_row_pages, row_bounds, split_budget
from flexicache.profiling.pages import tail_page_mass
from flexicache.selection import attended_slots, select_pages


@given(st.integers(1, 3), st.integers(1, 6), st.integers(0, 2**31 - 1), st.booleans())
def test_split_budget_is_the_best_split_within_the_bounds(heads, width, seed, ties):
    generator = torch.Generator().manual_seed(seed)
    gains = torch.rand(heads, width, generator=generator, dtype=torch.float64)
    if ties:
        gains = (gains * 3).round() / 3
    gains = gains.sort(dim=1, descending=True).values
    low = torch.randint(0, 3, (heads,), generator=generator)
    high = low + torch.randint(0, width + 2, (heads,), generator=generator)
    total = int(torch.randint(int(low.sum()), int(high.sum()) + 1, (1,), generator=generator))
    pages = split_budget(gains, total, low, high)
    assert int(pages.sum()) == total and bool((pages >= low).all()) and bool((pages <= high).all())

    def value(split) -> tuple[float, int]:  # summed gains; pages beyond the width rank below every real page
        return (sum(float(gains[h, :min(n, width)].sum()) for h, n in enumerate(split)),
                -sum(max(0, n - width) for n in split))

    best = max(value(split) for split in itertools.product(*(range(lo, hi + 1) for lo, hi in zip(low.tolist(),
                                                                                                  high.tolist())))
               if sum(split) == total)
    ours = value(pages.tolist())
    assert ours[1] == best[1] and ours[0] == pytest.approx(best[0], abs=1e-12)


def test_split_budget_refuses_bounds_that_cannot_meet_the_total():
    with pytest.raises(ValueError, match="cannot split 10 pages"):
        split_budget(torch.zeros(2, 4), 10, torch.tensor([2, 2]), torch.tensor([4, 4]))


def test_a_head_attending_to_one_page_gives_its_budget_to_a_head_attending_everywhere():
    """Head 0's queries hit one key (all its mass in one page), head 1's attention is uniform: the split gives head
    0 its sink and tail and head 1 the rest; the gains are the sorted page masses."""
    page_size, length, dim = 4, 64, 8
    keys = torch.zeros(1, 2, length, dim, dtype=torch.float64)
    keys[0, 0, 21, 0] = 200.0  # head 0: page 5 takes every query's attention
    query = torch.zeros(1, 2, length, dim, dtype=torch.float64)
    query[0, 0, :, 0] = 1.0
    gains = prompt_page_gains(tail_page_mass(query, keys, None, page_size, window=8), 16)
    assert gains.shape == (1, 2, 16)
    torch.testing.assert_close(gains[0, 0, 0], torch.tensor(1.0, dtype=torch.float32), atol=1e-6, rtol=0)
    assert float(gains[0, 0, 1:].abs().max()) < 1e-6
    assert bool((gains[0, 1, :-1] >= gains[0, 1, 1:]).all())  # non-increasing
    torch.testing.assert_close(gains.sum(dim=-1), torch.ones(1, 2), atol=1e-5, rtol=0)
    settings = FlexiCacheConfig(token_budget=32, page_size=page_size)  # K = 8, standby K: at most 16
    pages = prompt_row_pages(gains, settings, unstable_heads=[0, 1])
    assert pages.tolist() == [[2, 14]]


@pytest.mark.parametrize("where", ["right", "middle"])
def test_prompt_gains_of_a_request_padded_anywhere_are_its_own(where: str) -> None:
    generator = torch.Generator().manual_seed(4)
    query, keys = torch.randn(2, 4, 40, 8, generator=generator), torch.randn(2, 2, 40, 8, generator=generator)
    real = torch.ones(2, 40, dtype=torch.bool)
    real[1, {"right": slice(27, 40), "middle": slice(10, 23)}[where]] = False
    gains = prompt_page_gains(tail_page_mass(query, keys, real, 8, window=64), 5)
    alone = prompt_page_gains(tail_page_mass(query[1:, :, real[1]], keys[1:, :, real[1]], None, 8, window=64), 4)
    torch.testing.assert_close(gains[1, :, :4], alone[0], atol=0, rtol=0)
    assert bool(gains[1, :, 4:].isneginf().all())
    last_ten = tail_page_mass(query[:, :, -10:], keys, real, 8, window=64)[1]
    expected_queries = 0 if where == "right" else 10  # right: the last ten positions are all padding
    assert last_ten.shape == (2, expected_queries, 4)


def test_prompt_gains_of_a_left_padded_request_are_its_own():
    generator = torch.Generator().manual_seed(3)
    query, keys = torch.randn(2, 4, 40, 8, generator=generator), torch.randn(2, 2, 40, 8, generator=generator)
    real = torch.ones(2, 40, dtype=torch.bool)
    real[1, :13] = False
    gains = prompt_page_gains(tail_page_mass(query, keys, real, 8, window=64), 5)
    alone = prompt_page_gains(tail_page_mass(query[1:, :, 13:], keys[1:, :, 13:], None, 8, window=64), 4)
    torch.testing.assert_close(gains[1, :, :4], alone[0], atol=1e-6, rtol=0)
    assert bool(gains[1, :, 4:].isneginf().all())  # no fifth page of real tokens
    # the last queries alone (what a shared prefill hands the commit) give the same gains
    last = prompt_page_gains(tail_page_mass(query[:, :, -20:], keys, real, 8, window=20), 5)
    torch.testing.assert_close(last, prompt_page_gains(tail_page_mass(query, keys, real, 8, window=20), 5), atol=0,
                               rtol=0)


def test_a_layer_with_one_kv_head_keeps_k():
    """Gemma 3's paged layers have one KV head: nothing to split, the same pages as ``"uniform"``."""
    gains = torch.rand(2, 1, 40).sort(dim=-1, descending=True).values
    settings = FlexiCacheConfig(token_budget=64, page_size=8)
    assert prompt_row_pages(gains, settings, [0]).tolist() == prompt_row_pages(gains, settings, []).tolist() == [[8], [8]]


def test_row_bounds_keep_the_stable_heads_at_k_without_standby_pages():
    unstable = torch.tensor([True, False])
    low, high = row_bounds(FlexiCacheConfig(token_budget=64, page_size=8), unstable)  # 3K candidates, K standby
    assert low.tolist() == [2, 2] and high.tolist() == [24, 16]
    low, high = row_bounds(FlexiCacheConfig(token_budget=64, page_size=8, standby_pages=0, exact_candidates=2),
                           unstable)
    assert low.tolist() == [2, 8] and high.tolist() == [16, 8]


@pytest.mark.parametrize(("candidates", "standby"), [(3, "auto"), (1, "auto"), (2, 0), (1, 0)])
def test_max_row_pages_bounds_every_split(candidates, standby):
    """The width that sizes the table kernel's row block (``max_row_pages``) is the largest share ``row_bounds``
    allows any head, stable or unstable, and ``K`` when every head keeps ``K``."""
    settings = FlexiCacheConfig(token_budget=64, page_size=8, exact_candidates=candidates, standby_pages=standby)
    _, high = row_bounds(settings, torch.tensor([True, False]))
    assert settings.max_row_pages == int(high.max())
    uniform = FlexiCacheConfig(token_budget=64, page_size=8, exact_candidates=candidates, standby_pages=standby,
                               head_budgets="uniform")
    assert uniform.max_row_pages == 8


@given(st.integers(1, 5), st.integers(1, 12), st.integers(0, 2**31 - 1), st.booleans())
def test_per_row_k_selects_what_each_row_selects_with_its_own_k(rows, width, seed, force_last):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, width, generator=generator).round()
    num_pages = torch.randint(0, width + 1, (rows,), generator=generator)
    row_k = torch.randint(2, width + 3, (rows,), generator=generator)
    pages, page_scores = select_pages(scores, num_pages, row_k, force_last)
    for row in range(rows):
        alone, alone_scores = select_pages(scores[row:row + 1], num_pages[row:row + 1], int(row_k[row]), force_last)
        listed = pages[row][pages[row] >= 0]
        assert listed.tolist() == alone[0][alone[0] >= 0].tolist()
        assert page_scores[row][: listed.numel()].tolist() == alone_scores[0][: listed.numel()].tolist()
    selected = torch.randperm(width, generator=generator).repeat(rows, 1)
    counts = torch.randint(0, width + 1, (rows,), generator=generator)
    chosen = attended_slots(scores, selected, counts)
    for row in range(rows):
        assert torch.equal(chosen[row], attended_slots(scores[row:row + 1], selected[row:row + 1], int(counts[row]))[0])


@pytest.mark.parametrize("exact,candidates", [(True, 2), (True, 3), (False, 2)], ids=["exact", "exact-3K", "box"])
@pytest.mark.parametrize("standby", [0, "auto"])
def test_decode_equals_dense_attention_over_each_rows_own_pages(exact, candidates, standby):
    """Random q/k/v through every layer: each row attends to its own ``K_r`` pages (the backend contract holds:
    ``min(K_r, pages)`` listed, the tail last), and the output is dense attention over exactly those (fp64)."""
    config = tiny_config(group=2, num_kv_heads=3, num_layers=3, head_dim=8)
    profile = HeadProfile(3, 3, 8, [(0, 0), (0, 1), (0, 2), (1, 2)])
    cache = checked(FlexiCache(config, profile=profile, token_budget=32, page_size=4, rerank_interval=3,
                               standby_pages=standby, exact_rescore=exact, exact_candidates=candidates,
                               head_budgets="prompt"))
    driver = Driver(config, cache, seed=11)
    # Head 0's prompt keys sharpen its attention (its mass sits on few pages), head 2's flatten it.
    sharpness = torch.tensor([4.0, 1.0, 0.25], dtype=torch.float64).view(1, 3, 1, 1)
    keys = [driver.randn(2, 3, 90, 8) * sharpness for _ in range(3)]
    driver.prefill([90, 61], k=keys)
    split = [layer.storage.row_pages_host.view(2, 3) for layer in cache.layers]
    for layer, pages in zip(cache.layers, split, strict=True):
        assert pages.sum(dim=1).tolist() == [3 * 8, 3 * 8]
        low, high = row_bounds(cache.settings, torch.tensor([h in layer.unstable_heads for h in range(3)]))
        assert bool((pages >= low).all()) and bool((pages <= high).all())
        if len(layer.unstable_heads) == 3 or standby:  # every head free to move: the sharp head gives pages away
            assert bool((pages[:, 0] < pages[:, 2]).all()), pages
    since = [layer_idx % 3 for layer_idx in range(3)]
    for step in range(12):
        driver.decode()
        for layer_idx in range(3):
            since[layer_idx] += 1
            due = since[layer_idx] >= 3
            since[layer_idx] = 0 if due else since[layer_idx]
            expected = expected_decode(driver, cache, layer_idx, reranked=due)
            torch.testing.assert_close(driver.outputs[layer_idx].double(), expected, rtol=0, atol=1e-12,
                                       msg=f"step {step} layer {layer_idx}")


def test_a_covering_budget_equals_dynamic_cache():
    model = tiny_model(tiny_config(num_kv_heads=3, num_layers=2))
    ids, mask = left_pad([random_prompt(40, 1), random_prompt(27, 2)])
    assert_same_generation(model, ids, mask, 10, token_budget=128, page_size=4, head_budgets="prompt")


def test_a_left_padded_batch_decodes_as_each_request_alone():
    model = tiny_model(tiny_config(num_kv_heads=3, num_layers=3))
    prompts = [random_prompt(150, 4), random_prompt(97, 5), random_prompt(121, 6)]
    assert_batch_matches_alone(model, prompts, profile="default", token_budget=32, page_size=4, head_budgets="prompt")


def test_each_request_is_split_over_its_own_tokens_without_a_profile():
    """The online head split is one per batch, the page split one per request: each request's is its split alone
    (with K standby pages a stable and an unstable head have the same bounds)."""
    model = tiny_model(tiny_config(num_kv_heads=3, num_layers=3))
    model.set_attn_implementation("flexicache")
    prompts = [random_prompt(150, 4), random_prompt(97, 5)]
    ids, mask = left_pad(prompts)
    settings = {"token_budget": 32, "page_size": 4, "head_budgets": "prompt"}
    cache = FlexiCache(model.config, **settings)
    model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2, do_sample=False)
    for row, prompt in enumerate(prompts):
        alone = FlexiCache(model.config, **settings)
        model.generate(prompt.view(1, -1), past_key_values=alone, max_new_tokens=2, do_sample=False)
        for batched, single in zip(cache.layers, alone.layers, strict=True):
            assert batched.storage.row_pages_host.view(2, 3)[row].tolist() == single.storage.row_pages_host.tolist()


def test_selected_requests_keep_their_split():
    model = tiny_model(tiny_config(num_kv_heads=3, num_layers=2))
    model.set_attn_implementation("flexicache")
    ids, mask = left_pad([random_prompt(120, 7), random_prompt(88, 8), random_prompt(101, 9)])
    cache = checked(FlexiCache(model.config, profile="default", token_budget=32, page_size=4, head_budgets="prompt"))
    model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=3, do_sample=False)
    before = [layer.storage.row_pages_host.view(3, 3).clone() for layer in cache.layers]
    cache.batch_select_indices(torch.tensor([2, 0]))
    for layer, split in zip(cache.layers, before, strict=True):
        assert layer.storage.row_pages_host.view(2, 3).tolist() == split[[2, 0]].tolist()


def test_bad_head_budgets_are_refused():
    with pytest.raises(ValueError, match="head_budgets must be 'uniform'"):
        FlexiCacheConfig(head_budgets="per-layer")
