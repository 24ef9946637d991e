"""``flexicache bench`` in its CPU mode: every case runs, writes its outputs, and its numbers are consistent.

No timing assertions: only counts, bytes and the arithmetic that links the reported numbers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from flexicache.benchmarks.cli import add_arguments, settings_from, update_markdown
from flexicache.benchmarks.decode import measurement_order
from flexicache.benchmarks.measure import summarize
from flexicache.benchmarks.report import find, render_report, targets
from flexicache.benchmarks.rerank import rerank_summary
from flexicache.benchmarks.suite import PRESETS, System, model_config
from flexicache.benchmarks.throughput import left_padded, mix_requests
from flexicache.cli import main

CPU = PRESETS["cpu"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """One CPU run of the whole suite, through the ``flexicache`` command line."""
    out = tmp_path_factory.mktemp("bench")
    assert main(["bench", "--device", "cpu", "--out", str(out)]) == 0
    return json.loads((out / "bench.json").read_text()), out


def rows(results: dict, case: str) -> list[dict]:
    return results["cases"][case]["rows"]


def test_outputs_written_and_nothing_failed(bench):
    results, out = bench
    for name in ("bench.json", "report.md", "memory.png", "decode_speedup.png", "rerank.png"):
        assert (out / name).stat().st_size > 0, name
    assert results["plots"] == ["memory.png", "decode_speedup.png", "rerank.png"]
    for case, data in results["cases"].items():
        for skipped in data["skipped"]:  # only what cannot run on a CPU is skipped
            assert "needs CUDA" in skipped["reason"], (case, skipped)
    assert results["env"]["torch"] and results["settings"]["device"] == "cpu"
    report = (out / "report.md").read_text()
    for title in ("#### Targets", "#### Memory vs context", "#### Decode step latency", "#### Rerank ablation",
                  "#### Largest batch", "#### Offline mix", "![rerank.png](rerank.png)"):
        assert title in report


def test_memory_flexicache_below_dense(bench):
    results, _ = bench
    memory = rows(results, "memory")
    assert {row["context"] for row in memory} == set(CPU["memory_contexts"])
    for context in CPU["memory_contexts"]:
        dynamic, dense = find(memory, system="dynamic", context=context), find(memory, system="dense", context=context)
        flexi = find(memory, system="flexicache-64", context=context)
        assert dynamic["dense_kv_bytes"] == dense["dense_kv_bytes"] == flexi["dense_kv_bytes"]
        assert dynamic["device_kv_bytes"] == dynamic["dense_kv_bytes"] and dynamic["host_kv_bytes"] == 0
        assert dense["device_kv_bytes"] >= dynamic["device_kv_bytes"] and dense["host_kv_bytes"] == 0
        # budget 64 < context: FlexiCache keeps less on the device than dense, the stable heads' pages on the host
        flexi_device = flexi["device_kv_bytes"] + flexi["device_metadata_bytes"]
        assert flexi_device < dense["device_kv_bytes"] + dense["device_metadata_bytes"]
        assert flexi["device_kv_bytes"] < dynamic["device_kv_bytes"]
        assert 0 < flexi["host_kv_bytes"] <= flexi["host_reserved_bytes"]
        assert flexi["device_fraction_of_dense"] == pytest.approx(flexi_device / flexi["dense_kv_bytes"])
        full = flexi["full_depth"]
        assert full["device_bytes"] == pytest.approx(flexi_device * full["layers"] / flexi["layers"])
    shares = [find(memory, system="flexicache-64", context=c)["device_fraction_of_dense"] for c in CPU["memory_contexts"]]
    assert shares == sorted(shares, reverse=True)  # the share falls as the context grows past the budget


def test_decode_rows_consistent(bench):
    results, _ = bench
    decode = rows(results, "decode")
    config = model_config("tiny-llama", CPU["layers"])
    assert len(decode) == len(CPU["decode_contexts"]) * len(CPU["decode_batches"]) * len(CPU["decode_systems"])
    for row in decode:
        assert row["step_ms_p99"] >= row["step_ms_p50"] > 0
        assert row["tokens_per_s"] == pytest.approx(1000 * row["batch"] / row["step_ms_p50"])
        assert row["full_depth"]["tokens_per_s"] == pytest.approx(1000 * row["batch"] / row["full_depth"]["step_ms_p50"])
        if row["system"] == "quest-64":  # every head reranks every step, nothing moves
            rows_per_step = row["batch"] * config.num_key_value_heads * config.num_hidden_layers
            assert row["reranks_unstable_per_step"] == rows_per_step
            assert row["reranks_stable_per_step"] == row["bytes_h2d_per_step"] == 0
        if row["system"] == "flexicache-64":  # one of 4 heads per layer unstable
            assert row["reranks_unstable_per_step"] == row["batch"] * config.num_hidden_layers
            assert row["host_kv_bytes"] > 0
    loops = {loop["batch"]: loop for loop in results["loop"]}
    assert set(CPU["decode_batches"]) <= set(loops)
    for loop in loops.values():
        assert loop["fixed_ms"] >= 0
        assert loop["full_depth_step_ms"] == pytest.approx(loop["fixed_ms"] + 4 * loop["per_layer_ms"])


def test_rerank_ablation_counts(bench):
    results, _ = bench
    summary = rerank_summary(rows(results, "rerank"))
    assert list(summary) == ["no_rerank", "stability_aware", "every_step", "quest_like"]
    config = model_config("tiny-llama", CPU["layers"])
    all_rows = CPU["attention_batch"] * config.num_key_value_heads * config.num_hidden_layers
    unstable_rows = CPU["attention_batch"] * config.num_hidden_layers
    assert summary["no_rerank"]["reranked_rows_per_step"] == 0 and summary["no_rerank"]["rerank_ms"] == 0
    assert summary["every_step"]["reranked_rows_per_step"] == summary["quest_like"]["reranked_rows_per_step"] == all_rows
    assert unstable_rows < summary["stability_aware"]["reranked_rows_per_step"] < all_rows
    for name in ("stability_aware", "every_step"):
        assert 0 < summary[name]["promoted_fraction"] <= 1
        assert summary[name]["h2d_bytes_per_step"] > 0
    assert summary["quest_like"]["h2d_bytes_per_step"] == summary["no_rerank"]["h2d_bytes_per_step"] == 0
    assert "rerank_cost_vs_stability_aware" in summary["every_step"]


def test_throughput_capacity_arithmetic(bench):
    results, _ = bench
    for row in rows(results, "throughput"):
        batch, per_sequence = row["largest_batch"], row["device_bytes_per_sequence_full"]
        assert batch >= 1
        assert row["weights_full_bytes"] + batch * per_sequence <= row["device_limit_bytes"]
        assert batch * row["host_bytes_per_sequence_full"] <= row["host_limit_bytes"]
        over = row["weights_full_bytes"] + (batch + 1) * per_sequence > row["device_limit_bytes"]
        over_host = (batch + 1) * row["host_bytes_per_sequence_full"] > row["host_limit_bytes"]
        assert {"device": over, "host": over_host, "max_batch": batch == CPU["max_batch"]}[row["bound"]]
        assert row["tokens_per_s"] == pytest.approx(1000 * batch / row["step_ms_p50"])
    flexi = find(rows(results, "throughput"), system="flexicache-64")
    dynamic = find(rows(results, "throughput"), system="dynamic")
    assert flexi["host_bytes_per_sequence_full"] > 0 == dynamic["host_bytes_per_sequence_full"]


def test_mix_counts(bench):
    results, _ = bench
    requests = mix_requests(CPU["mix_requests"], CPU["mix_input"], CPU["mix_output"], 0)
    ordered = sorted(requests)
    batches = [ordered[i:i + CPU["mix_batch"]] for i in range(0, len(ordered), CPU["mix_batch"])]
    decode_steps = sum(max(out for _, out in batch) - 1 for batch in batches)
    for row in rows(results, "mix"):
        assert row["decode_steps"] == decode_steps
        assert row["decode_steps_measured"] <= decode_steps
        assert row["total_s"] == pytest.approx(row["prefill_s"] + row["decode_s"])
        assert row["requests_per_s"] == pytest.approx(len(requests) / row["total_s"])


def test_targets_and_rerender(bench, tmp_path):
    results, out = bench
    entries = targets(results)
    assert len(entries) == 8
    assert {entry["status"] for entry in entries} <= {"met", "NOT met", "pending", "reported"}
    assert entries[1]["status"] == "pending"  # the dense FlashInfer comparison needs CUDA
    assert all(entry["status"] != "pending" for i, entry in enumerate(entries) if i != 1)
    assert main(["bench", "--report-from", str(out / "bench.json"), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "report.md").read_text() == (out / "report.md").read_text()
    document = tmp_path / "BENCHMARKS.md"
    document.write_text("# B\n<!-- flexicache-bench:start -->\nold\n<!-- flexicache-bench:end -->\ntail\n")
    update_markdown(document, render_report(results, plot_prefix="bench"))
    text = document.read_text()
    assert "old" not in text and text.endswith("<!-- flexicache-bench:end -->\ntail\n")
    assert "![memory.png](bench/memory.png)" in text


# ------------------------------------------------------------------------------------------------ pure helpers


def test_system_names():
    assert (System("flexicache-1024").kind, System("flexicache-1024").budget) == ("flexicache", 1024)
    assert (System("quest-512").kind, System("dense").budget) == ("quest", None)
    assert System("dynamic-offload").attn_implementation == "sdpa"
    for bad in ("flexicache", "quest-x", "sparse-1024", "dense-1024"):
        with pytest.raises(ValueError, match="unknown system"):
            System(bad)


def test_settings_validation():
    with pytest.raises(SystemExit):
        main(["bench", "--device", "cpu", "--decode-systems", "flexicache-100"])  # not a multiple of 16
    with pytest.raises(SystemExit):
        main(["bench", "--device", "cpu", "--layers", "9"])
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    settings = settings_from(parser.parse_args(["--device", "cpu", "--steps", "3", "--mix-input", "10", "20"]))
    assert (settings.steps, settings.mix_input, settings.layers) == (3, [10, 20], CPU["layers"])


def test_measurement_order_puts_targets_first():
    order = measurement_order([1024, 10240, 32768], [1, 8, 32], 32768, 8, 1024)
    assert order[:2] == [(32768, 8), (1024, 8)] and sorted(order) == sorted(
        (c, b) for c in [1024, 10240, 32768] for b in [1, 8, 32])


def test_summarize_and_mix_helpers():
    stats = summarize([1.0, 2.0, 3.0, 10.0])
    assert stats["step_ms_p50"] == 2.5 and stats["step_ms_p99"] == 10.0 and stats["p99_over_p50"] == 4.0
    requests = mix_requests(50, [10240, 30720], [50, 1500], 0)
    assert all(10240 <= n <= 30720 and 50 <= out <= 1500 for n, out in requests)
    ids, mask = left_padded([3, 5], 100, torch.device("cpu"), 0)
    assert mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]] and ids[0, :2].tolist() == [0, 0]
