"""``flexicache diagnose``: recall and output error of page selections against hand-computed and covering cases."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import random_prompt, tiny_config, tiny_model

from flexicache.config import FlexiCacheConfig
from flexicache.diagnostics import selectors
from flexicache.diagnostics.recall import StepView, evaluate, score_mask, step_view
from flexicache.diagnostics.report import diagnose, write
from flexicache.diagnostics.trace import record_trace


@pytest.fixture(scope="module")
def trace():
    config = tiny_config(group=2, num_kv_heads=2, num_layers=2)
    model = tiny_model(config, seed=4)
    model.set_attn_implementation("sdpa")
    return record_trace(model, random_prompt(70, seed=9).tolist(), prefill=58, progress=False)


def test_trace_holds_every_steps_query_and_the_final_keys(trace) -> None:
    assert trace.queries.shape == (12, 2, 4, 8) and trace.keys.shape == (2, 2, 70, 8)
    assert trace.context(0) == 59 and trace.context(11) == 70
    view = step_view(trace, 3)
    assert view.weights.shape == (4, 2, 62)
    torch.testing.assert_close(view.weights.sum(-1), torch.ones(4, 2, dtype=torch.float64))


def test_recall_and_error_of_a_hand_built_mask() -> None:
    weights = torch.tensor([[[0.5, 0.25, 0.125, 0.125], [0.1, 0.2, 0.3, 0.4]]], dtype=torch.float64)  # [1, 2, 4]
    values = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.0]]], dtype=torch.float64)
    view = StepView(torch.zeros(1, 2, 2), torch.zeros(1, 4, 2, dtype=torch.float64), values, weights)
    mask = torch.tensor([[True, True, False, False]])
    scores = score_mask(view, mask)
    assert scores.recall.item() == pytest.approx((0.75 + 0.3) / 2)
    dense = weights[0] @ values[0]
    sparse = torch.stack([weights[0, g, :2] / weights[0, g, :2].sum() for g in range(2)]) @ values[0, :2]
    expected_error = ((sparse - dense).norm(dim=-1) / dense.norm(dim=-1)).mean()
    assert scores.output_error.item() == pytest.approx(float(expected_error))
    assert scores.tokens.item() == 2


def test_a_budget_covering_the_context_keeps_all_attention(trace) -> None:
    settings = FlexiCacheConfig(token_budget=80, page_size=8)
    result = evaluate(trace, {"flexicache": selectors.flexicache(settings),
                              "oracle": selectors.oracle_pages(80, 8), "tokens": selectors.oracle_tokens(80)})
    for scores in result.values():
        torch.testing.assert_close(scores.recall, torch.ones(4, dtype=torch.float64), rtol=0, atol=1e-12)
        assert float(scores.output_error.max()) < 1e-12


def test_oracles_bound_the_cache_selection_and_the_pages_are_whole(trace) -> None:
    settings = FlexiCacheConfig(token_budget=16, page_size=4)
    result = evaluate(trace, {"flexicache": selectors.flexicache(settings), "oracle": selectors.oracle_pages(16, 4),
                              "tokens": selectors.oracle_tokens(16)})
    assert bool((result["oracle"].recall >= result["flexicache"].recall - 1e-12).all())
    assert bool((result["tokens"].recall >= result["oracle"].recall - 1e-12).all())
    assert bool((result["oracle"].recall < 1).any())
    view = step_view(trace, 0)
    mask = selectors.flexicache(settings)(view)
    pages = torch.nn.functional.pad(mask, (0, -mask.shape[1] % 4)).view(4, -1, 4)
    assert bool((pages.all(-1) == pages.any(-1))[:, :-1].all())  # whole pages (the tail page may be partial)
    assert bool(mask[:, :4].all()) and bool(mask[:, -1].all())  # sink and tail pages


def test_refined_selection_lies_between_flexicaches_and_the_oracles(trace) -> None:
    """Refining the box scores' top 2K pages by true mass keeps at least FlexiCache's mass (its K pages are among
    the candidates) and at most the oracle pages'; with every page a candidate it is the oracle pages."""
    settings = FlexiCacheConfig(token_budget=16, page_size=4)
    result = evaluate(trace, {"flexicache": selectors.flexicache(settings), "oracle": selectors.oracle_pages(16, 4),
                              "refined": selectors.refined(settings, 2), "all": selectors.refined(settings, 100)})
    assert bool((result["refined"].recall >= result["flexicache"].recall - 1e-12).all())
    assert bool((result["oracle"].recall >= result["refined"].recall - 1e-12).all())
    assert bool((result["refined"].recall > result["flexicache"].recall + 1e-6).any())
    torch.testing.assert_close(result["all"].recall, result["oracle"].recall, rtol=0, atol=1e-12)
    mask = selectors.refined(settings, 2)(step_view(trace, 5))
    assert bool((mask.sum(-1) <= 16).all()) and bool(mask[:, :4].all()) and bool(mask[:, -1].all())


def test_diagnose_writes_json_and_plots(trace, tmp_path) -> None:
    settings = FlexiCacheConfig(token_budget=16, page_size=4)
    result = diagnose(trace, settings, [16, 32], range(0, 12, 3), progress=False)
    paths = write(result, tmp_path)
    stored = json.loads((tmp_path / "diagnosis.json").read_text())
    assert set(stored["budgets"]) == {"16", "32"}
    row = stored["budgets"]["16"]
    assert set(row) == {"flexicache", "refined_2x", "quest", "oracle_pages", "oracle_tokens"}
    assert len(row["flexicache"]["recall_by_head"]) == 2 and len(row["flexicache"]["recall_by_head"][0]) == 2
    assert stored["budgets"]["32"]["oracle_pages"]["recall"] >= row["oracle_pages"]["recall"]
    quest = evaluate(trace, {"q": selectors.flexicache(dataclasses.replace(settings, spread_weight=1.0,
                                                                           principal_bounds=False))},
                     list(range(0, 12, 3)))["q"]
    assert row["quest"]["recall"] == pytest.approx(float(quest.recall.mean()))
    pytest.importorskip("matplotlib")
    assert {path.name for path in paths} == {"diagnosis.json", "recall_by_head.png", "recall_vs_budget.png"}
