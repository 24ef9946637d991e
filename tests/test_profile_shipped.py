"""The shipped SmolLM2-135M-Instruct profile: shape, self-consistency, reports, plots."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from flexicache.profile import HeadProfile
from flexicache.profiles import shipped_profile_path
from flexicache.profiling.stability import lowest_count

NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def profile() -> HeadProfile:
    return HeadProfile.from_pretrained(NAME)


def smollm2_config(**overrides) -> LlamaConfig:
    shape = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    shape["head_dim"] = 64
    return LlamaConfig(**{**shape, **overrides}, intermediate_size=1536, vocab_size=49152)


def test_shape_and_settings(profile):
    profile.validate_for(smollm2_config())
    with pytest.raises(ValueError, match="made for a model with 30 layers, 3 KV heads.*has 30 layers, 9 KV heads"):
        profile.validate_for(smollm2_config(num_key_value_heads=9))
    assert profile.model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert (profile.page_size, profile.token_budget, profile.unstable_fraction) == (16, 256, 0.25)
    assert len(profile.unstable_heads) == lowest_count(90, 0.25)
    assert profile.model_info["gguf_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_unstable_set_follows_from_the_stored_counts_and_scores(profile):
    counts = torch.tensor(profile.calibration["bottom_quantile_counts"]).flatten()
    scores = torch.tensor(profile.scores).flatten()
    ranked = sorted(range(90), key=lambda i: (-int(counts[i]), float(scores[i]), i))
    expected = sorted((i // 3, i % 3) for i in ranked[: len(profile.unstable_heads)])
    assert profile.unstable_heads == expected
    assert [tuple(pair) for pair in profile.calibration["unstable_order"]] == [(i // 3, i % 3) for i in ranked[:23]]


def test_reports_and_reproduction_command(profile):
    calibration = profile.calibration
    assert calibration["command"].startswith("flexicache profile --model smollm2 ")
    assert set(calibration["samples"]) == {"code", "docs", "kv", "passkey"}
    reports = calibration["reports"]
    agreement = reports["cross_task_agreement"]
    assert len(agreement["tasks"]) == 4 and 0 <= agreement["min"] <= agreement["mean"] <= agreement["max"] <= 1
    assert 0 < reports["promoted_fraction"]["promoted"]["stable"] < 1
    curves = reports["rco_vs_distance"]
    assert len(curves["stable_mean"]) == len(curves["unstable_mean"]) == 16
    assert {"per_request_overlap", "spearman_vs_profile_scores"} <= set(reports["online_estimate"])
    assert {"topk_overlap", "unstable_set_overlap"} <= set(reports["attention_mass"])


def test_plots_ship_beside_the_profile():
    folder = Path(shipped_profile_path(NAME)).parent
    for suffix in ("heatmap", "rco"):
        assert (folder / f"{NAME}.{suffix}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
