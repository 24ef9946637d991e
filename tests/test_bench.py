"""``flexicache bench`` in its CPU mode: every case runs, writes its outputs, and its numbers are consistent.

No timing assertions: only counts, bytes and the arithmetic that links the reported numbers.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

import pytest
import torch

from flexicache.benchmarks.cli import add_arguments, settings_from
from flexicache.benchmarks.decode import calibration, extrapolate, measurement_order
from flexicache.benchmarks.document import END, find_sections, render_document
from flexicache.benchmarks.headlines import headlines
from flexicache.benchmarks import measure
from flexicache.benchmarks.measure import build_model, fill_cache, summarize
from flexicache.benchmarks.memory import offload_full_depth
from flexicache.benchmarks.report import render_report
from flexicache.benchmarks.rerank import rerank_summary, timed_steps
from flexicache.benchmarks.results import NA, find, step_full_depth
from flexicache.benchmarks.suite import PRESETS, System, model_config
from flexicache.benchmarks.throughput import left_padded, mix_requests
from flexicache.cli import main

CPU = PRESETS["cpu"]
ROOT = Path(__file__).resolve().parents[1]
GPU_RUNS = sorted((ROOT / "eval" / "results" / "gpu").glob("**/bench.json"))


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
    assert "| p50 per round |" in report
    for title in ("#### Headline numbers", "#### Memory vs context", "#### Decode step latency", "#### Rerank ablation",
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
    loops = {loop["batch"]: loop for loop in results["loop"]}
    for row in decode:
        assert row["rounds"] == len(row["round_p50_ms"]) == CPU["decode_rounds"] == 2
        assert len(row["step_samples_ms"]) == CPU["decode_rounds"] * CPU["steps"]  # the rounds' steps pooled
        assert row["step_ms_p50"] == pytest.approx(statistics.median(row["step_samples_ms"]))
        assert min(row["round_p50_ms"]) <= row["step_ms_p50"] <= max(row["round_p50_ms"])
        assert row["step_ms_p99"] >= row["step_ms_p50"] > 0
        assert row["tokens_per_s"] == pytest.approx(1000 * row["batch"] / row["step_ms_p50"])
        if not loops[row["batch"]]["consistent"]:  # an inconsistent calibration gives no estimate
            assert row["full_depth"] is None
        elif row["full_depth"] is not None:
            full = row["full_depth"]
            assert full["step_ms_p50"] > 0
            assert full["tokens_per_s"] == pytest.approx(1000 * row["batch"] / full["step_ms_p50"])
        if row["system"] == "quest-64":  # every head reranks every step, nothing moves
            rows_per_step = row["batch"] * config.num_key_value_heads * config.num_hidden_layers
            assert row["reranks_unstable_per_step"] == rows_per_step
            assert row["reranks_stable_per_step"] == row["bytes_h2d_per_step"] == 0
        if row["system"] == "flexicache-64":  # one of 4 heads per layer unstable
            assert row["reranks_unstable_per_step"] == row["batch"] * config.num_hidden_layers
            assert row["host_kv_bytes"] > 0
    assert set(CPU["decode_batches"]) <= set(loops)
    for loop in loops.values():
        assert len(loop["samples_ms_1_layer"]) == len(loop["samples_ms"]) == loop["rounds"] >= 3
        assert loop["step_ms_1_layer"] == pytest.approx(sorted(loop["samples_ms_1_layer"])[loop["rounds"] // 2])
        if loop["consistent"]:
            assert loop["per_layer_ms"] > 0 and loop["fixed_ms"] >= 0 and loop["step_ms_1_layer"] < loop["step_ms"]
            assert loop["full_depth_step_ms"] == pytest.approx(loop["fixed_ms"] + 4 * loop["per_layer_ms"])
        else:
            assert loop["inconsistency"] and loop["fixed_ms"] is loop["full_depth_step_ms"] is None


def test_rerank_ablation_counts(bench):
    results, _ = bench
    summary = rerank_summary(rows(results, "rerank"))
    assert list(summary) == ["no_rerank", "stability_aware", "every_step", "quest_like"]
    config = model_config("tiny-llama", CPU["layers"])
    all_rows = CPU["attention_batch"] * config.num_key_value_heads * config.num_hidden_layers
    unstable_rows = CPU["attention_batch"] * config.num_hidden_layers
    assert summary["no_rerank"]["reranked_rows_per_step"] == 0 and summary["no_rerank"]["rerank_ms"] == 0
    steps = timed_steps(CPU["layer_steps"], 16)
    assert steps % 16 == 0 and all(item["timed_steps"] == steps for item in summary.values())
    # every layer's stable heads rerank once per interval in the window: the mean holds all of them
    stable_rows = CPU["attention_batch"] * (config.num_key_value_heads - 1) * config.num_hidden_layers
    assert rows(results, "rerank")[1]["window"]["reranks_stable"] == stable_rows * steps // 16
    assert summary["every_step"]["reranked_rows_per_step"] == summary["quest_like"]["reranked_rows_per_step"] == all_rows
    assert unstable_rows < summary["stability_aware"]["reranked_rows_per_step"] < all_rows
    for name in ("stability_aware", "every_step"):
        assert 0 < summary[name]["promoted_fraction"] <= 1
        assert summary[name]["h2d_bytes_per_step"] > 0
    assert summary["quest_like"]["h2d_bytes_per_step"] == summary["no_rerank"]["h2d_bytes_per_step"] == 0
    every, aware = summary["every_step"], summary["stability_aware"]
    for item in (every, aware):  # rerank time = mean step over the floor's mean, one run
        assert item["rerank_ms"] == pytest.approx(item["step_ms_mean"] - summary["no_rerank"]["step_ms_mean"])
    assert summary["quest_like"]["rerank_ms"] is None  # no host tier: not comparable with the floor
    if aware["rerank_ms"] > 0:
        assert every["rerank_time_vs_stability_aware"] == pytest.approx(every["rerank_ms"] / aware["rerank_ms"])
    assert every["rows_vs_stability_aware"] == pytest.approx(all_rows / aware["reranked_rows_per_step"])


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


def test_memory_batch_and_chunked_prefill(bench, tmp_path):
    """``--memory-batch`` scales the KV with the batch; ``--prefill-chunk`` reaches generate (its rows and notes
    record it; tests/test_cache_equivalence.py checks that chunked prefill runs in chunks and keeps the tokens)."""
    results, _ = bench
    out = tmp_path / "chunked"
    assert main(["bench", "--device", "cpu", "--cases", "memory", "--memory-contexts", "512", "--memory-systems",
                 "dynamic", "flexicache-64", "--memory-batch", "2", "--prefill-chunk", "128", "--out", str(out)]) == 0
    chunked = json.loads((out / "bench.json").read_text())
    memory = rows(chunked, "memory")
    assert {(row["batch"], row["prefill_chunk"]) for row in memory} == {(2, 128)}
    single = find(rows(results, "memory"), system="dynamic", context=512)
    assert find(memory, system="dynamic", context=512)["dense_kv_bytes"] == 2 * single["dense_kv_bytes"]
    flexi = find(memory, system="flexicache-64", context=512)
    assert flexi["device_kv_bytes"] < flexi["dense_kv_bytes"]
    assert "Batch 2, real prefill (chunks of 128 tokens)" in chunked["cases"]["memory"]["notes"][0]


def test_headlines_and_rerender(bench, tmp_path):
    results, out = bench
    lines = headlines(results)
    # one per FlexiCache system and decode point, the long/short ratio, memory, rerank, throughput, mix, the loop
    assert any(line.startswith("flexicache-64 at 512 tokens x batch 1") for line in lines)
    assert sum(line.startswith("flexicache-64, ") for line in lines) == len(CPU["decode_contexts"]) * len(
        CPU["decode_batches"])
    assert any("flexicache-64's step at 512 tokens is" in line for line in lines)
    assert any("the stability-aware schedule's rerank time" in line or "not measured" in line for line in lines)
    assert any(line.startswith("flexicache-64: largest batch at 512 tokens") for line in lines)
    assert any(line.startswith("offline mix of 4 requests") for line in lines)
    assert headlines(results, ["rerank"]) == [line for line in lines if "rerank" in line]
    assert not re.search(r"\b(met|targets?|issue)\b", " ".join(lines))  # no thresholds in the package
    assert main(["bench", "--report-from", str(out / "bench.json"), "--out", str(tmp_path)]) == 0
    stated = ("Report (every derived number, table and plot) rendered from its `bench.json` by: `python -m "
              f"flexicache.cli bench --report-from {out / 'bench.json'} --out {tmp_path}`\n\n")
    rendered = (tmp_path / "report.md").read_text()
    assert stated in rendered and rendered.replace(stated, "") == (out / "report.md").read_text()


def test_update_benchmarks_rewrites_the_generated_sections(bench, tmp_path):
    """``--update-benchmarks`` replaces the text between each section's markers (and nothing else) by the report of
    the bench.json the marker names, refuses a run that no section names (before measuring), and renders a
    ``cases=`` section with those cases only."""
    results, out = bench
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "bench.json").write_text((out / "bench.json").read_text())
    document = tmp_path / "BENCHMARKS.md"
    head = "# B\n\n<!-- flexicache-bench results/bench.json -->\n"
    middle = f"{END}\n\nhand-written text\n\n<!-- flexicache-bench results/bench.json cases=rerank -->\nold\n"
    document.write_text(head + "stale\n" + middle + f"{END}\ntail\n")
    assert main(["bench", "--report-from", str(folder / "bench.json"), "--out", str(folder),
                 "--update-benchmarks", str(document)]) == 0
    text = document.read_text()
    assert "stale" not in text and "\nold\n" not in text and "hand-written text" in text and text.endswith(f"{END}\ntail\n")
    first, second = (text[section.start:section.end] for section in find_sections(text))
    assert "--out results --update-benchmarks BENCHMARKS.md`" in first  # re-measures into the section's folder
    assert "### Decode step latency" in first and "![memory.png](results/memory.png)" in first
    assert "### Rerank ablation" in second and "### Decode step latency" not in second
    assert "![rerank.png](results/rerank.png)" in second and "memory.png" not in second
    assert render_document(text, tmp_path, "BENCHMARKS.md") == text  # rendering again changes nothing

    other = tmp_path / "other"
    with pytest.raises(SystemExit, match="no generated section for .*other/bench.json: add the two lines"):
        main(["bench", "--device", "cpu", "--cases", "rerank", "--out", str(other), "--update-benchmarks",
              str(document)])
    assert not other.exists()  # refused before measuring
    document.write_text(head + "no end marker\n")
    with pytest.raises(ValueError, match="has no '<!-- /flexicache-bench -->' line"):
        find_sections(document.read_text())


def test_benchmarks_md_is_generated_from_its_stored_runs():
    """Every generated section of BENCHMARKS.md is what its stored bench.json renders to today (after a change of the
    report, run `flexicache bench --report-from ... --update-benchmarks BENCHMARKS.md`), every stored run is
    published, and every link into eval/results/gpu/ resolves."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert render_document(text, ROOT, "BENCHMARKS.md") == text
    sources = {(ROOT / section.source).resolve() for section in find_sections(text)}
    assert sources == {run.resolve() for run in GPU_RUNS}
    for link in re.findall(r"\]\((eval/results/gpu/[^)#]+)\)", text):
        assert (ROOT / link).exists(), link


def sections_by_anchor(text: str) -> dict[str, str]:
    """The ``## `` sections of a markdown text by their GitHub anchor, each with its heading."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("## "):
            current = re.sub(r"[^a-z0-9 _-]", "", line[3:].lower()).replace(" ", "-")
            sections[current] = [line]
        elif current:
            sections[current].append(line)
    return {anchor: "\n".join(lines) for anchor, lines in sections.items()}


def numbers(text: str) -> set[str]:
    """The numbers of ``text`` as written (``32k``-style context lengths left out)."""
    return set(re.findall(r"\d+(?:\.\d+)?(?![\dk])", text))


@pytest.mark.parametrize("document, link", [("BENCHMARKS.md", "#"), ("README.md", "BENCHMARKS.md#")])
def test_glance_tables_quote_their_sections(document, link):
    """Every number of a table row that links to a BENCHMARKS.md section appears in that section, so that an
    updated section cannot leave a stale number in the at-a-glance tables."""
    sections = sections_by_anchor((ROOT / "BENCHMARKS.md").read_text())
    rows = [line for line in (ROOT / document).read_text().splitlines()
            if line.startswith("| ") and f"]({link}" in line]
    assert len(rows) >= 4
    for row in rows:
        anchor = row.split(f"]({link}")[1].split(")")[0]
        assert anchor in sections, (document, anchor)
        missing = numbers(row.split("[")[0]) - numbers(sections[anchor])
        assert not missing, (row, missing)


# ------------------------------------------------------------------------------------------------ pure helpers


def test_system_names():
    assert (System("flexicache-1024").kind, System("flexicache-1024").budget) == ("flexicache", 1024)
    assert (System("quest-512").kind, System("dense").budget) == ("quest", None)
    assert System("dynamic-offload").attn_implementation == "sdpa"
    assert (System("static").kind, System("static").attn_implementation) == ("static", "sdpa")
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
    assert settings.exact_rescore is True  # FlexiCache's default
    box = settings_from(parser.parse_args(["--device", "cpu", "--exact-rescore", "false"]))
    assert System("flexicache-64").make_cache(tiny_bench_config(), tokens=96, settings=box).settings.exact_rescore is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--exact-rescore", "maybe"])
    for bad, message in ((["--unstable-fraction", "-0.25"], "--unstable-fraction must be in"),
                         (["--mix-max-steps", "0"], "must be at least 1"), (["--dtype", "nn"], "--dtype must be"),
                         (["--time-budget", "-1"], "take 0 or more"), (["--max-batch", "0"], "must be at least 1")):
        with pytest.raises(SystemExit, match=message):
            settings_from(parser.parse_args(["--device", "cpu", *bad]))


def test_the_rerank_case_runs_the_settings_of_the_run():
    """The rerank ablation's caches take the run's page size, standby pages and page choice (not the library's)."""
    from flexicache.benchmarks.suite import cache_options

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    settings = settings_from(parser.parse_args(["--device", "cpu", "--page-size", "16", "--standby-pages", "0",
                                                "--exact-rescore", "false", "--exact-candidates", "2",
                                                "--head-budgets", "uniform", "--cuda-graphs", "off"]))
    assert cache_options(settings) == {"page_size": 16, "standby_pages": 0, "exact_rescore": False,
                                       "exact_candidates": 2, "head_budgets": "uniform",
                                       "backend": settings.backend, "cuda_graphs": False}


def test_the_setup_line_names_the_page_selection():
    from flexicache.benchmarks.report import setup_lines

    run = json.loads((ROOT / "eval/results/gpu/h100_decode_defaults/bench.json").read_text())
    assert "keys' attention mass" in setup_lines(run)[2]  # a run with exact_rescore recorded
    assert "candidates per unstable head" not in setup_lines(run)[2]  # from before exact_candidates: 2 x K
    run["settings"].update(exact_candidates=3, head_budgets="prompt")
    assert "3 x K candidates per unstable head, pages split across each layer's KV heads" in setup_lines(run)[2]
    del run["settings"]["exact_rescore"]  # a run from before the setting: box scores
    assert "chosen by their box scores" in setup_lines(run)[2]


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


# ------------------------------------------------------------------------------------------- full-depth gating


def test_calibration_consistency():
    good = calibration(6.0, 9.0, 4, 32)  # 5 ms fixed + 1 ms per layer
    assert good["consistent"] and good["inconsistency"] is None
    assert (good["per_layer_ms"], good["fixed_ms"], good["full_depth_step_ms"]) == pytest.approx((1.0, 5.0, 37.0))
    assert extrapolate(good, 13.0, 4, 32) == pytest.approx(5.0 + 8 * 8.0)
    assert extrapolate(good, 4.0, 4, 32) is None  # below the fixed cost: no estimate
    for step_1, step_l in ((65.4, 9.83), (5.0, 5.0), (2.0, 9.0)):  # 1 layer slower / equal; negative fixed cost
        bad = calibration(step_1, step_l, 4, 32)
        assert not bad["consistent"] and bad["inconsistency"]
        assert bad["per_layer_ms"] is bad["fixed_ms"] is bad["full_depth_step_ms"] is None
        assert extrapolate(bad, 11.2, 4, 32) is None


def test_inconsistent_loop_of_an_older_run_gives_no_estimate():
    """A ``bench.json`` written before the gating (clamped fixed cost, negative full-depth numbers) renders n/a."""
    loop = {"model": "llama-3.1-8b", "batch": 8, "context": 1024, "step_ms_1_layer": 65.4, "step_ms": 9.83,
            "layers": 4, "per_layer_ms": -18.52, "fixed_ms": 65.4, "full_depth_step_ms": -527.3}
    row = {"model": "llama-3.1-8b", "batch": 8, "layers": 4, "step_ms_p50": 11.2,
           "full_depth": {"step_ms_p50": -368.2, "tokens_per_s": -22.0}}
    assert step_full_depth({"loop": [loop]}, row, 8) == (None, NA)
    assert step_full_depth({"loop": [dict(loop, step_ms_1_layer=6.0)]}, row, 8)[0]["step_ms_p50"] > 0
    assert step_full_depth({"loop": []}, row, 8) == (None, "-")


def test_offload_full_depth_keeps_one_layer_on_device():
    row = {"system": "dynamic-offload", "layers": 4, "device_kv_bytes": 100, "device_metadata_bytes": 0,
           "device_reserved_bytes": 100, "dense_kv_bytes": 400, "cache_allocated_bytes": 100,
           "full_depth": {"layers": 32, "device_bytes": 800, "device_kv_bytes": 800, "device_reserved_bytes": 800,
                          "host_reserved_bytes": 2400, "peak_bytes": 10_000}}
    full = offload_full_depth(row)
    assert (full["device_bytes"], full["host_reserved_bytes"], full["device_resident_layers"]) == (100, 3100, 1)
    assert full["peak_bytes"] == 10_000 - 7 * 100
    assert offload_full_depth(dict(row, full_depth=full)) == full  # idempotent


@pytest.mark.parametrize("run", GPU_RUNS, ids=lambda run: run.parent.name)
def test_stored_gpu_runs_render_without_broken_numbers(run):
    """Every stored run renders (old runs' rows included) naming its card (the H200, or the H100 of the h100_* runs):
    no negative number, no threshold, headlines."""
    results = json.loads(run.read_text())
    report = render_report(results)
    card = "1x NVIDIA H100" if run.parent.name.startswith("h100_") else "1x NVIDIA H200"
    assert card in report and "#### Headline numbers" in report
    assert not re.search(r"\| -\d", report) and "-0." not in report
    assert headlines(results) and "NOT met" not in report


def test_host_profile_times_each_part_and_restores_everything(tmp_path, monkeypatch, capsys):
    from transformers import AttentionInterface

    from flexicache import attention
    from flexicache.benchmarks import host_profile
    from flexicache.cache import FlexiLayer

    out = tmp_path / "steps.json"
    monkeypatch.setattr("sys.argv", ["host_profile", "--device", "cpu", "--model", "tiny-llama", "--layers", "2",
                                     "--context", "128", "--batch", "2", "--dtype", "float32", "--warmup", "2",
                                     "--steps", "4", "--profile-steps", "2", "--systems", "dynamic", "flexicache-64",
                                     "--cprofile", "--json", str(out)])
    host_profile.main()
    results = json.loads(out.read_text())
    assert set(results) == {"dynamic", "flexicache-64"}
    for name, timed in (("dynamic", "DynamicLayer.update"), ("flexicache-64", "FlexiLayer.decode")):
        assert len(results[name]["step_ms"]) == 4
        calls = {line.split()[0]: float(line.split()[1]) for line in results[name]["host_calls"].splitlines()[1:]}
        assert calls[timed] == 2.0  # one call per layer and step
    assert "Ordered by: internal time" in capsys.readouterr().out  # the cProfile tables
    assert FlexiLayer.decode.__qualname__ == "FlexiLayer.decode"  # the timers are gone again
    assert AttentionInterface()[attention.ATTENTION_NAME] is attention.flexicache_attention_forward


def test_decode_rows_survive_a_failing_loop_calibration(tmp_path, monkeypatch):
    from flexicache.benchmarks import decode

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(decode, "loop_cost", fail)
    assert main(["bench", "--device", "cpu", "--cases", "decode", "--decode-contexts", "128", "--decode-batches",
                 "1", "--decode-systems", "dynamic", "flexicache-64", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "bench.json").read_text())
    measured = rows(results, "decode")
    assert {row["system"] for row in measured} == {"dynamic", "flexicache-64"}
    assert all(row["full_depth"] is None and row["rounds"] == 2 for row in measured)
    reasons = [skipped["reason"] for skipped in results["cases"]["decode"]["skipped"]]
    assert len(reasons) == 2 and all("loop calibration error" in reason for reason in reasons)


def test_system_names_carry_flexicache_settings_after_a_colon():
    from flexicache.benchmarks.suite import Settings, System, system_options

    system = System("flexicache-64:spread_weight=1.0,group_reduce=sum")
    assert (system.kind, system.budget) == ("flexicache", 64)
    assert system_options(system.name) == {"spread_weight": 1.0, "group_reduce": "sum"}
    assert system_options("flexicache-64:max_promotions=none, page_size=8") == {"max_promotions": None, "page_size": 8}
    config = tiny_bench_config()
    cache = system.make_cache(config, tokens=96, settings=Settings())
    assert cache.settings.spread_weight == 1.0 and cache.settings.group_reduce == "sum"
    assert System("flexicache-64").make_cache(config, tokens=96, settings=Settings()).settings.spread_weight == 0.5
    with pytest.raises(ValueError, match="key=value"):
        System("flexicache-64:spread_weight")
    with pytest.raises(ValueError, match="FlexiCache's"):
        System("dynamic:spread_weight=1.0")


def tiny_bench_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def test_a_chunked_fill_puts_the_same_tokens_in_every_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fill writes chunk by chunk through every layer: DynamicCache and StaticCache end up with the same keys
    and values, and FlexiCache holds every token."""
    monkeypatch.setattr(measure, "FILL_CHUNK_BYTES", 48 * 2 * 2 * 2 * 8 * 4)  # 48 tokens of batch 2, 2 x 8 fp32
    config, settings = tiny_bench_config(), settings_from(argparse.Namespace(device="cpu"))
    model = build_model(config, torch.device("cpu"), torch.float32, seed=0)
    caches = {}
    for name in ("dynamic", "static", "flexicache-64"):
        system = System(name)
        model.set_attn_implementation(system.attn_implementation)
        caches[name] = cache = system.make_cache(config, 120, settings)
        writes = []
        update = cache.update
        cache.update = lambda keys, *args, update=update, writes=writes: writes.append(keys.shape[2]) or update(
            keys, *args)
        ids = fill_cache(model, cache, batch=2, context=100, seed=0)
        assert writes == [48, 48, 48, 48, 4, 4]  # three chunks, each through both layers
        assert ids.shape == (2, 101)
        assert caches[name].get_seq_length() == 100
    for layer in range(config.num_hidden_layers):
        dynamic, static = caches["dynamic"].layers[layer], caches["static"].layers[layer]
        assert torch.equal(static.keys[:, :, :100], dynamic.keys)
        assert torch.equal(static.values[:, :, :100], dynamic.values)


def test_the_throughput_case_steps_down_from_a_batch_that_runs_out_of_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from flexicache.benchmarks import throughput

    ran = []

    def decode_run(suite, model, system, batch, context, steps, profile_steps=0):
        ran.append(batch)
        if batch > 26:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")  # e.g. a kernel's workspace
        return {"step_ms_p50": 100.0, "tokens_per_s": 10.0 * batch, "layers": 2}

    monkeypatch.setattr(throughput, "largest_batch", lambda suite, name, system: {"largest_batch": 30})
    monkeypatch.setattr(throughput, "decode_run", decode_run)
    monkeypatch.setattr(throughput, "with_full_depth", lambda suite, name, batch, row: row)
    suite = argparse.Namespace(settings=settings_from(argparse.Namespace(device="cpu")), device=torch.device("cpu"),
                               model=lambda name: None)
    row = throughput.measure_throughput(suite, "tiny-llama", System("static"))
    assert ran == [30, 28, 26]
    assert (row["largest_batch"], row["estimated_batch"], row["out_of_memory_at"]) == (26, 30, [30, 28])
    assert row["tokens_per_s"] == 260.0

    ran.clear()
    monkeypatch.setattr(throughput, "largest_batch", lambda suite, name, system: {"largest_batch": 100})
    with pytest.raises(torch.OutOfMemoryError):  # 100, 95, 90, 85, 80 all fail: the error is not hidden
        throughput.measure_throughput(suite, "tiny-llama", System("static"))
    assert len(ran) == throughput.OOM_RETRIES + 1

    ran.clear()
    monkeypatch.setattr(throughput, "largest_batch", lambda suite, name, system: {"largest_batch": 3})
    monkeypatch.setattr(throughput, "decode_run", lambda suite, model, system, batch, *args: decode_run(
        suite, model, system, batch + 100, *args))  # every batch fails (ran: the batch + 100)
    with pytest.raises(torch.OutOfMemoryError, match="even a batch of 1"):  # 3, 2, 1 fail: no row without a run
        throughput.measure_throughput(suite, "tiny-llama", System("static"))
    assert ran == [103, 102, 101]

    ran.clear()
    monkeypatch.setattr(throughput, "largest_batch", lambda suite, name, system: {"largest_batch": 0})
    row = throughput.measure_throughput(suite, "tiny-llama", System("static"))  # nothing fits: nothing to run
    assert (ran, row["largest_batch"], row["out_of_memory_at"]) == ([], 0, [])
