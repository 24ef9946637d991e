"""``exact_rescore``: the attended pages chosen among candidates by their keys' attention mass."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    assert_batch_matches_alone,
    assert_same_generation,
    checked,
    dense_cache,
    greedy,
    mixed_profile,
    needs_fast_cuda_path,
    random_prompt,
    tiny_config,
    tiny_model,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from flexicache import FlexiCache, FlexiCacheConfig
from flexicache.selection import exact_page_scores, select_candidates, select_pages


def test_exact_page_scores_are_the_group_summed_attention_share_of_each_page():
    generator = torch.Generator().manual_seed(0)
    rows, group, pages, page_size, dim, scale = 3, 2, 5, 4, 8, 0.35
    query = torch.randn(rows, group, dim, generator=generator, dtype=torch.float64)
    keys = torch.randn(rows, pages, page_size, dim, generator=generator, dtype=torch.float64)
    page_lens = torch.tensor([[4, 4, 4, 4, 2], [4, 0, 4, 4, 4], [4, 4, 1, 0, 0]])
    scores = exact_page_scores(query, keys, page_lens, scale)
    for row in range(rows):
        expected = torch.zeros(pages, dtype=torch.float64)
        for head in range(group):
            logits = [(keys[row, p, :page_lens[row, p]] @ query[row, head]) * scale for p in range(pages)]
            total = torch.cat(logits).exp().sum()
            expected += torch.stack([lg.exp().sum() for lg in logits]) / total
        for page in range(pages):
            if page_lens[row, page] == 0:
                assert scores[row, page] == float("-inf")
            else:  # computed in float32
                torch.testing.assert_close(scores[row, page].exp().double(), expected[page], rtol=1e-5, atol=1e-7)


def test_exact_scores_find_the_page_a_box_score_misses():
    """Page 1 holds one key aligned with the query; page 2's keys spread over a large box but each one points
    away from the query: the box bound ranks page 2 first, the exact mass page 1."""
    query = torch.tensor([[[1.0, 1.0]]])
    keys = torch.tensor([[[[0.0, 0.0], [0.0, 0.0]],
                          [[3.0, 0.0], [0.0, 0.0]],
                          [[2.9, -9.0], [-9.0, 2.9]]]])
    bound = (keys[0].amax(1) * query[0, 0]).sum(-1)  # Quest's bound for a positive query: q . kmax
    assert int(bound.argmax()) == 2
    scores = exact_page_scores(query, keys, torch.full((1, 3), 2), 1.0)
    assert int(scores.argmax()) == 1


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 4), st.integers(2, 12), st.integers(2, 7), st.randoms(use_true_random=False))
def test_selecting_among_candidates_selects_what_a_page_indexed_row_selects(rows, num_pages, k, rng):
    """The candidates' columns chosen by their scores are the pages select_pages chooses from a row holding those
    scores at the candidates and -inf elsewhere (sink and tail forced, ties to the lower page): the torch path does
    the first, the Triton kernels the second."""
    width = num_pages + 2
    candidates = torch.full((rows, width), -1)
    scores = torch.full((rows, width), float("-inf"))
    page_row = torch.full((rows, width), float("-inf"))
    for row in range(rows):
        middle = [p for p in range(1, num_pages - 1) if rng.random() < 0.5]
        listed = sorted({0, num_pages - 1, *middle})
        candidates[row, :len(listed)] = torch.tensor(listed)
        for column, page in enumerate(listed):
            value = rng.choice([float("-inf"), 0.0, 1.0, rng.random()])
            scores[row, column] = page_row[row, page] = value
    columns = select_candidates(candidates, scores, k)
    pages = torch.where(columns >= 0, candidates.gather(1, columns.clamp(min=0)), -1)
    expected, _ = select_pages(page_row, torch.full((rows,), num_pages), k, force_last=True)
    assert torch.equal(pages, expected)


def test_a_covering_budget_generates_what_dynamic_cache_generates():
    config = tiny_config("llama", group=2, num_kv_heads=2, num_layers=2)
    model = tiny_model(config, seed=1)
    ids = random_prompt(90, seed=5).view(1, -1)
    assert_same_generation(model, ids, None, 10, profile=mixed_profile(config), token_budget=128, page_size=8,
                           exact_rescore=True)


@pytest.mark.parametrize("family,group", [("llama", 2), ("qwen2", 4)])
def test_left_padded_batch_equals_each_request_alone(family, group):
    config = tiny_config(family, group=group, num_kv_heads=2, num_layers=2)
    model = tiny_model(config, seed=2)
    prompts = [random_prompt(n, seed=40 + n) for n in (150, 70, 41)]
    assert_batch_matches_alone(model, prompts, max_new_tokens=20, profile=mixed_profile(config), token_budget=32,
                               page_size=4, rerank_interval=3, exact_rescore=True)


def test_the_option_changes_the_selection_and_keeps_byte_accounting():
    """Same prompt, budget well below the context: the exact choice differs from the box choice somewhere, and
    the device and host bytes are those of the default selection (it only picks other pages)."""
    config = tiny_config("llama", group=2, num_kv_heads=2, num_layers=2)
    model = tiny_model(config, seed=3)
    prompt = random_prompt(240, seed=9).view(1, -1)
    outputs, stats = [], []
    for exact in (False, True):
        cache = checked(FlexiCache.from_model(model, profile=mixed_profile(config), token_budget=32, page_size=4,
                                              exact_rescore=exact))
        outputs.append(greedy(model, prompt, cache, None, 16, logits=True)[1])
        stats.append(cache.stats())
    assert any(not torch.equal(a, b) for a, b in zip(*outputs))
    for key in ("device_kv_bytes", "device_metadata_bytes", "host_kv_bytes", "decode_steps"):
        assert stats[0][key] == stats[1][key], key
    _, dense_logits = greedy(model, prompt, dense_cache(model), None, 16, logits=True)
    assert torch.equal(outputs[1][0], dense_logits[0])  # the prefill stays dense


def test_exact_rescore_must_be_a_bool():
    with pytest.raises(ValueError, match="exact_rescore must be True or False"):
        FlexiCacheConfig(exact_rescore="yes")


@pytest.mark.parametrize("candidates", [0, 9, 2.5, "3", True])
def test_exact_candidates_must_be_a_multiple_of_k_from_1_to_8(candidates):
    with pytest.raises(ValueError, match="exact_candidates"):
        FlexiCacheConfig(exact_candidates=candidates)
    assert FlexiCacheConfig(token_budget=64, page_size=8, exact_candidates=3).candidate_pages == 24


@needs_fast_cuda_path
@pytest.mark.parametrize("candidates", [2, 3])
def test_on_cuda_the_triton_kernels_choose_what_the_torch_path_chooses(candidates):
    """On CUDA the option runs in the Triton kernels: with the torch reference backend in float64 (the fused eager
    path) it generates what the CPU's torch path generates (logits to 1e-4); with FlashInfer in bfloat16 its
    whole-step graphs generate what the same kernels generate launched one by one."""
    config = tiny_config("llama", group=2, num_kv_heads=2, num_layers=2, head_dim=64)
    prompt = random_prompt(300, seed=11).view(1, -1)
    settings = {"profile": mixed_profile(config), "token_budget": 64, "page_size": 8, "standby_pages": 2,
                "exact_rescore": True, "exact_candidates": candidates}
    runs = []
    for device in ("cpu", "cuda"):
        model = tiny_model(config, seed=4).to(device)
        cache = FlexiCache.from_model(model, backend="reference", **settings)
        runs.append(greedy(model, prompt.to(device), cache, None, 12, logits=True))
    assert torch.equal(runs[0][0], runs[1][0].cpu())
    for ours, theirs in zip(runs[0][1], runs[1][1]):  # CUDA's kernels sum in other orders (measured 2e-5)
        torch.testing.assert_close(ours, theirs.cpu(), rtol=0, atol=1e-4)
    model = tiny_model(config, seed=4, dtype=torch.bfloat16).to("cuda")
    graphed = FlexiCache.from_model(model, **settings)
    tokens = greedy(model, prompt.cuda(), graphed, None, 24)
    assert graphed.stats()["step_graph_replays"] > 0
    eager = FlexiCache.from_model(model, cuda_graphs=False, **settings)
    assert torch.equal(tokens, greedy(model, prompt.cuda(), eager, None, 24))
