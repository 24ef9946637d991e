"""``rerank_warmup``: the stable heads rerank every step for the first decode steps after a prompt, then on the
staggered schedule (which the warm-up does not shift); the host-side check a whole-step graph uses agrees; a covering
budget still generates what DynamicCache generates; bad values are refused."""

from __future__ import annotations

import pytest
from conftest import (
    assert_same_generation,
    checked,
    greedy,
    mixed_profile,
    random_prompt,
    tiny_config,
    tiny_model,
)

from flexicache import FlexiCache, HeadProfile
from flexicache.layer import FlexiLayer


def rerank_steps(layer_idx: int, steps: int, interval: int, warmup: int) -> list[int]:
    """The decode steps (1-based) at which layer ``layer_idx``'s stable heads rerank."""
    return [step for step in range(1, steps + 1)
            if step <= warmup or (layer_idx % interval + step) % interval == 0]


@pytest.mark.parametrize("warmup", [0, 5, 12])
def test_stable_heads_rerank_every_step_of_the_warmup_then_on_the_staggered_schedule(
        warmup: int, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tiny_config(group=2, num_kv_heads=2, num_layers=3)
    model = tiny_model(config, seed=5)
    all_stable = HeadProfile(3, 2, config.head_dim, [])
    cache = checked(FlexiCache.from_model(model, profile=all_stable, token_budget=16, page_size=4, rerank_interval=4,
                                          rerank_warmup=warmup))
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    count = FlexiLayer._count_decode_step

    def recording_count(self: FlexiLayer, plan: object) -> int:
        due = self.rerank_due(plan)  # what a whole-step graph's host side asks before the step
        width = count(self, plan)
        assert due == bool(width)
        if width:
            seen[self.layer_idx].append(self.num_chunks)  # decode steps so far (one prompt chunk first)
        return width

    monkeypatch.setattr(FlexiLayer, "_count_decode_step", recording_count)
    greedy(model, random_prompt(40, seed=6).view(1, -1), cache, max_new_tokens=15)
    steps = 14  # the first new token comes from the prompt forward
    assert seen == {layer: rerank_steps(layer, steps, 4, warmup) for layer in range(3)}
    rows = 2  # stable KV heads x batch 1, per layer
    assert cache.stats()["reranks_stable"] == rows * sum(1 + len(seen[layer]) for layer in range(3))  # + the prompt's


def test_a_covering_budget_with_a_warmup_generates_what_dynamic_cache_generates() -> None:
    config = tiny_config(group=2, num_kv_heads=2, num_layers=2)
    model = tiny_model(config, seed=7)
    ids = random_prompt(37, seed=8).view(1, -1)
    assert_same_generation(model, ids, None, 20, profile=mixed_profile(config), token_budget=64,
                                        page_size=8, rerank_warmup=8)


@pytest.mark.parametrize("bad", [-1, 1.5, "4", True])
def test_a_bad_warmup_is_refused_with_what_to_pass(bad: object) -> None:
    with pytest.raises((TypeError, ValueError), match="rerank_warmup"):
        FlexiCache(tiny_config(), rerank_warmup=bad)
