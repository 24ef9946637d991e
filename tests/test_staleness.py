"""What a head gains from being unstable (flexicache.profiling.staleness, the online split's default score): zero for
a head whose attention stays on one page, large for one whose attention moves to another page at every step, nan for
a prompt whose pages all fit the budget, a split that makes the moving heads unstable, and the setting's checks."""

from __future__ import annotations

import pytest
import torch
from conftest import greedy, left_pad, random_prompt, tiny_config, tiny_model

from flexicache import FlexiCache, HeadProfile, head_split
from flexicache import layer as layer_module
from flexicache.config import FlexiCacheConfig
from flexicache.evaluation.methods import FlexiCacheMethod
from flexicache.head_split import request_stability, unstable_heads_by_score
from flexicache.profiling.pages import page_bounds, tail_page_mass
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
    mass = torch.stack(tail_page_mass(query, key, None, PAGE, WINDOW))
    return prompt_staleness_gain(query, key, mass, pages_per_head, standby, 3 * pages_per_head, PAGE, horizon=4)


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


def reference_gain(query: torch.Tensor, key: torch.Tensor, pages_per_head: int, standby: int, candidates: int,
                   page_size: int, horizon: int, every: int) -> torch.Tensor:
    """The module docstring's definition for one request, written plainly over boolean page sets ``[P]``."""
    _, _, length, _ = key.shape
    window, k = query.shape[2], pages_per_head - 1
    mass = tail_page_mass(query, key, None, page_size, window)[0].double()  # [H, W, P]
    kmin, kmax = page_bounds(key[0], page_size)
    group = query.shape[1] // key.shape[1]
    box = torch.einsum("hgwd,hpd->hgwp", query[0].view(key.shape[1], group, window, -1).clamp(min=0), kmax)
    box = (box + torch.einsum("hgwd,hpd->hgwp", query[0].view(key.shape[1], group, window, -1).clamp(max=0),
                              kmin)).amax(dim=1)  # [H, W, P]
    full = [(length - window + w) // page_size for w in range(window)]

    def top(score: torch.Tensor, allowed: list[int], count: int) -> set[int]:
        ranked = sorted(allowed, key=lambda page: (page != 0, -float(score[page]), page))  # the sink first
        return set(ranked[:count])

    def held_mass(head: int, w: int, held: set[int]) -> float:
        return sum(sorted((float(mass[head, w, page]) for page in held), reverse=True)[:k])

    gains = []
    for head in range(key.shape[1]):
        oracle = [held_mass(head, w, set(range(full[w]))) for w in range(window)]
        unstable = [oracle[w] - held_mass(head, w, top(box[head, w], list(range(full[w])), candidates))
                    for w in range(window)]
        horizon = min(horizon, window)
        stable_losses, unstable_losses = [], []
        for start in range(0, window - horizon + 1, every):
            working_set = top(box[head, start], list(range(full[start])), k + standby)
            for w in range(start, start + horizon):
                stable_losses.append(oracle[w] - held_mass(head, w, working_set | set(range(full[start], full[w]))))
                unstable_losses.append(unstable[w])
        gains.append(sum(stable_losses) / len(stable_losses) - sum(unstable_losses) / len(unstable_losses))
    return torch.tensor(gains, dtype=torch.float64)


@pytest.mark.parametrize(("length", "page_size", "pages_per_head", "standby", "horizon", "every"),
                         [(64, 2, 3, 0, 4, 2), (150, 8, 5, 5, 16, 2), (97, 4, 6, 2, 7, 3)])
def test_the_gain_matches_its_definition_written_plainly(length: int, page_size: int, pages_per_head: int,
                                                         standby: int, horizon: int, every: int) -> None:
    generator = torch.Generator().manual_seed(length)
    query = 2 * torch.randn(1, 4, 24, 16, generator=generator)
    key = 2 * torch.randn(1, 2, length, 16, generator=generator)
    mass = torch.stack(tail_page_mass(query, key, None, page_size, 24))
    fast = prompt_staleness_gain(query, key, mass, pages_per_head, standby, 3 * pages_per_head, page_size, horizon,
                                 every)[0]
    expected = reference_gain(query, key, pages_per_head, standby, 3 * pages_per_head, page_size, horizon, every)
    torch.testing.assert_close(fast.double(), expected, atol=1e-5, rtol=0)


def test_the_split_makes_the_heads_whose_attention_moves_unstable() -> None:
    """Four KV heads of one layer, two moving: the quarter plus the default profile's floor picks the moving ones."""
    settings = FlexiCacheConfig(token_budget=6, page_size=PAGE, standby_pages=0, rerank_interval=4)
    fixed, moving = [5] * WINDOW, [2 + w for w in range(WINDOW)]
    query, key = one_hot_prompt([fixed, moving, [7] * WINDOW, [20 - w for w in range(WINDOW)]])
    scores = request_stability(query, key, None, settings)[0]  # the queries of the last 16 positions
    assert unstable_heads_by_score([scores], [[]], 0.5) == [[1, 3]]


@pytest.mark.parametrize("head_budgets", ["prompt", "uniform"])
def test_each_layer_computes_its_prompt_tail_attention_once_for_both_readers(monkeypatch: pytest.MonkeyPatch,
                                                                             head_budgets: str) -> None:
    """The page split and the staleness score read one :func:`tail_page_mass` per layer, and the scores the split
    parks are those it would compute from the chunk itself."""
    config = tiny_config(group=2, num_kv_heads=4, num_layers=4)
    model = tiny_model(config, seed=1)
    tail_masses, parked = [], []
    original_mass, original_stability = layer_module.tail_page_mass, head_split.request_stability

    def counted_mass(*args: object) -> list[torch.Tensor]:
        tail_masses.append(original_mass(*args))
        return tail_masses[-1]

    def checked_stability(query: torch.Tensor, keys: torch.Tensor, real_tokens: torch.Tensor | None,
                          settings: FlexiCacheConfig, tail_mass: list[torch.Tensor] | None = None) -> torch.Tensor:
        scores = original_stability(query, keys, real_tokens, settings, tail_mass)
        torch.testing.assert_close(scores, original_stability(query, keys, real_tokens, settings), atol=0, rtol=0)
        parked.append(tail_mass)
        return scores

    monkeypatch.setattr(layer_module, "tail_page_mass", counted_mass)
    monkeypatch.setattr(head_split, "request_stability", checked_stability)
    for prompts in ([random_prompt(300, seed=2)], [random_prompt(300, seed=3), random_prompt(220, seed=4)]):
        tail_masses.clear()
        parked.clear()
        ids, mask = left_pad(prompts)
        cache = FlexiCache.from_model(model, token_budget=48, page_size=16, head_budgets=head_budgets)
        greedy(model, ids, cache, mask, max_new_tokens=3)
        assert len(tail_masses) == 4 and [id(mass) for mass in parked] == [id(mass) for mass in tail_masses]


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
