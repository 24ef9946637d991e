"""flexicache.warm_up: one short generation that reaches every kernel a model's decode uses (CPU: the code path)."""

from __future__ import annotations

import pytest
from conftest import mixed_profile, tiny_config, tiny_model

from flexicache import warm_up


def test_warm_up_reaches_every_layers_rerank_and_a_page_boundary():
    """Every layer with stable heads reranks them, the tokens cross a page boundary (a full tail page of each stable
    head retires to the host tier), and the model is left prepared like ``from_model`` leaves it."""
    config = tiny_config(num_kv_heads=2, num_layers=3)
    model = tiny_model(config, seed=1)
    result = warm_up(model, context=37, batch_size=2, profile=mixed_profile(config), token_budget=24, page_size=8,
                     rerank_interval=4)
    assert result["new_tokens"] == 4 + 8 + 1 and result["decode_steps"] == result["new_tokens"] - 1
    stable_rows = 2 * (1 + 2)  # batch x stable heads of layers 1 and 2
    assert result["reranks_stable"] == stable_rows * (1 + result["decode_steps"] // 4)  # prefill, then every 4 steps
    prefill_offload = stable_rows * 37 * 2 * config.head_dim * 8  # K and V of the prompt, float64
    assert result["bytes_d2h"] > prefill_offload  # full tail pages retired at page boundaries
    assert result["seconds"] > 0
    assert model.config._attn_implementation == "flexicache"


@pytest.mark.parametrize(("context", "batch_size"), [(0, 1), (16, 0)])
def test_warm_up_refuses_empty_work(context: int, batch_size: int):
    model = tiny_model(tiny_config(num_layers=1), seed=0)
    with pytest.raises(ValueError, match="context >= 1 and batch_size >= 1.*real work"):
        warm_up(model, context=context, batch_size=batch_size)
