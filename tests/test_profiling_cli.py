"""`flexicache profile` end to end on a tiny random-weight Llama saved to a folder, and the plots."""

from __future__ import annotations

import json

import pytest
import torch
from test_profiling_data import char_tokenizer
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

from flexicache.cli import main
from flexicache.profile import HeadProfile
from flexicache.profiling.plots import plot_profile

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = char_tokenizer()
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_cli_end_to_end(model_dir, tmp_path, capsys):
    out, plots = tmp_path / "tiny.json", tmp_path / "plots"
    (tmp_path / "story.txt").write_text("It was a dark and stormy night; the rain fell in torrents. " * 60)
    argv = [
        "profile", "--model", str(model_dir),
        "--data", "synthetic:passkey", "synthetic:code", str(tmp_path / "story.txt"),
        "--samples-per-task", "2", "--prompt-tokens", "160", "--steps", "40", "--budget", "48", "--fraction", "0.5",
        "--batch-size", "2", "--attention-mass", "--online-window", "16", "--out", str(out), "--plots", str(plots),
        "--no-progress",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "cross-task agreement" in printed and "newly promoted" in printed

    profile = HeadProfile.load(out)
    profile.validate_for(AutoConfig.from_pretrained(model_dir))
    assert (profile.num_layers, profile.num_kv_heads, profile.head_dim) == (3, 2, 8)
    assert (profile.page_size, profile.token_budget, profile.unstable_fraction) == (16, 48, 0.5)
    assert len(profile.unstable_heads) == 3 and profile.model == str(model_dir)
    scores = torch.tensor(profile.scores)
    assert scores.shape == (3, 2) and ((scores >= -1) & (scores <= 1)).all()
    # the unstable heads are the ones most often in a sample's bottom quartile, ties by lower score
    counts = torch.tensor(profile.calibration["bottom_quantile_counts"])
    unstable = profile.unstable_mask()
    assert counts[unstable].min() >= counts[~unstable].max()

    calibration = profile.calibration
    assert calibration["command"].startswith("flexicache profile --model ")
    assert "--budget 48" in calibration["command"] and "--attention-mass" in calibration["command"]
    assert "--dtype float32 --device cpu" in calibration["command"]  # --dtype auto, resolved on the CPU
    assert calibration["samples"] == {"code": 2, "passkey": 2, "story": 2}
    assert calibration["settings"]["k"] == 3
    reports = calibration["reports"]
    assert reports["cross_task_agreement"]["tasks"] == ["code", "passkey", "story"]
    assert len(reports["rco_vs_distance"]["stable_mean"]) == 16
    assert 0 <= reports["promoted_fraction"]["promoted"]["all"] <= 1
    assert 0 <= reports["attention_mass"]["topk_overlap"] <= 1
    assert set(reports["online_estimate"]) >= {"per_request_overlap", "mean_estimate_overlap", "random_baseline"}
    assert profile.model_info["num_attention_heads"] == 4
    json.dumps(profile.to_dict())  # JSON-ready throughout

    for name in ("tiny.heatmap.png", "tiny.rco.png"):
        assert (plots / name).read_bytes()[:8] == PNG_MAGIC


def test_cli_rejects_prompts_that_fit_the_budget(model_dir, tmp_path):
    argv = [
        "profile", "--model", str(model_dir), "--data", "synthetic:kv", "--samples-per-task", "1",
        "--prompt-tokens", "32", "--steps", "8", "--budget", "256", "--out", str(tmp_path / "x.json"), "--no-progress",
    ]
    with pytest.warns(UserWarning, match="Skipped 1"), pytest.raises(ValueError, match="token_budget"):
        main(argv)


def test_plots_need_scores(tmp_path):
    bare = HeadProfile(num_layers=2, num_kv_heads=2, head_dim=8, unstable_heads=[(0, 0)])
    with pytest.raises(ValueError, match="scores"):
        plot_profile(bare, tmp_path, "bare")
