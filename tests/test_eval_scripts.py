"""The GPU profiling scripts under eval/ still import and parse their arguments on a machine without CUDA, and the
cache internals they reach exist (eval/begin_step_host_time.py runs whole in tests/test_step_graph.py)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path
from types import ModuleType

import pytest
import torch

EVAL = Path(__file__).resolve().parents[1] / "eval"


def run_script(name: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(EVAL.parent / "src"), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(EVAL / name), *args], env=env, capture_output=True, text=True,
                            timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout


@pytest.mark.parametrize("name", ["gpu_step_profile.py", "gpu_prefill_profile.py", "gpu_prefill_breakdown.py",
                                  "gpu_eigh_overlap.py", "gpu_kernel_sweep.py", "gpu_repeatability.py",
                                  "gpu_end_to_end.py", "gpu_model_step_profile.py", "gpu_head_budgets.py",
                                  "gpu_recording_breakdown.py"])
def test_gpu_profiling_scripts_parse_their_arguments(name: str) -> None:
    assert "usage:" in run_script(name, "--help")


def test_model_step_profile_groups_kernels_by_kind() -> None:
    """eval/gpu_model_step_profile.py puts each kernel of a profiled step in the group its name says."""
    group_of = load_script("gpu_model_step_profile.py").group_of
    assert group_of("nvjet_sm90_tst_64x8_64x16_2x1_v_bz_TNT").startswith("dense matmuls")
    assert group_of("void cublasLt::splitKreduce_kernel<32, 16, int, float>").startswith("dense matmuls")
    assert group_of("void flashinfer::BatchPrefillWithPagedKVCacheKernel<true>") == "FlashInfer attention"
    assert group_of("_candidates_kernel") == group_of("_copy_pages_kernel") == "FlexiCache Triton kernels"
    assert group_of("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>").startswith("elementwise")
    assert group_of("Memcpy DtoD (Device -> Device)") == "copies"
    assert group_of("cudnn_generated_fort_native_sdpa_sm80_flash_fprop").startswith("sdpa attention")
    assert group_of("_page_mass2_kernel") == "FlexiCache Triton kernels"
    assert group_of("void cuda::some_unlisted_kernel") == "other"


def test_stable_rerank_variants_patch_only_inside_their_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """eval/stable_rerank_variants.py: the successor variant lifts each page to its predecessor's score less the
    margin, the recent-queries variant takes each page's best score over the kept queries, and every variant puts
    FlexiCache's methods back when its block ends."""
    from flexicache import decode_paths, layer

    script = load_script("stable_rerank_variants.py")
    scores = torch.tensor([[5.0, 1.0, 0.0, 9.0]])
    monkeypatch.setattr(decode_paths.TorchDecode, "stable_scores", lambda self, query, num_tokens, width: scores)
    originals = (decode_paths.TorchDecode.__dict__["stable_scores"], decode_paths.TorchDecode.__dict__["rerank_stable"],
                 layer.FlexiLayer.__dict__["decode"])
    query = torch.zeros(1, 1, 4)  # head dim 4: a margin of 1 logit is 2 in score units
    for name in ("successor, margin=1", "recent queries"):
        with script.variant(name):
            if name.startswith("successor"):
                lifted = decode_paths.TorchDecode.stable_scores(None, query, None, 4)
                assert lifted.tolist() == [[5.0, 3.0, 0.0, 9.0]]  # from the scores before the lift
            else:
                assert layer.FlexiLayer.__dict__["decode"] is not originals[2]  # it keeps the recent queries
        assert (decode_paths.TorchDecode.__dict__["stable_scores"], decode_paths.TorchDecode.__dict__["rerank_stable"],
                layer.FlexiLayer.__dict__["decode"]) == originals
    # the recent-queries scores: each page's best over the current and the kept queries (scores stubbed as queries)
    monkeypatch.setattr(decode_paths.TorchDecode, "stable_scores", lambda self, query, num_tokens, width: query)
    kept = [torch.tensor([[0.0, 7.0, 0.0, 0.0]]), torch.tensor([[6.0, 0.0, 2.0, 0.0]])]
    storage = types.SimpleNamespace(recent_queries=kept, stable_index=None, group_queries=lambda past, heads: past,
                                    bound_rows=lambda past, heads: past)
    current = torch.tensor([[5.0, 1.0, 0.0, 9.0]])
    best = script.recent_query_scores()(types.SimpleNamespace(storage=storage), current, None, 4)
    assert best.tolist() == [[6.0, 7.0, 2.0, 9.0]]
    totals = {"dense": [math.log(2.0) * 10, 10], "defaults": [math.log(2.2) * 10, 10]}
    assert script.summary_table(totals).splitlines()[-1] == "| defaults | 2.200 | 1.100 |"


def test_layer_budget_split_keeps_the_total_budget() -> None:
    """eval/layer_budget_split.py's split of the stored diagnosis: one of the diagnosis' budgets per layer, their mean
    the middle budget, and more summed recall than the same budget everywhere."""
    script = load_script("layer_budget_split.py")
    diagnosis = json.loads(script.DIAGNOSIS.read_text())
    split = script.recall_maximising_split(diagnosis)
    assert len(split) == diagnosis["num_layers"] and set(split) <= set(script.BUDGETS)
    assert sum(split) == script.BUDGETS[1] * len(split)

    def recall(budget: int, layer: int) -> float:
        heads = diagnosis["budgets"][str(budget)]["flexicache"]["recall_by_head"][layer]
        return sum(heads) / len(heads)

    uniform = sum(recall(script.BUDGETS[1], layer) for layer in range(len(split)))
    assert sum(recall(budget, layer) for layer, budget in enumerate(split)) > uniform


def test_repeatability_check_runs_on_the_cpu() -> None:
    """The smoke test of eval/gpu_repeatability.py: its CPU configurations run and compare (on the CPU both are
    bit-identical run to run)."""
    out = run_script("gpu_repeatability.py", "--device", "cpu", "--repeats", "1", "--new-tokens", "3",
                     "--prompt-tokens", "40")
    assert "dynamic: 1 of 1 repeats bit-identical" in out and "flexicache-eager: 1 of 1 repeats bit-identical" in out


def test_end_to_end_runs_every_system_on_the_cpu() -> None:
    """The smoke test of eval/gpu_end_to_end.py: each system's generate runs and is timed."""
    out = run_script("gpu_end_to_end.py", "--device", "cpu", "--shape", "tiny-llama", "--context", "256",
                     "--batch", "2", "--budget", "64", "--new-tokens", "4", "--long-tokens", "8")
    systems = ("DynamicCache", "StaticCache", "FlexiCache(config)", "FlexiCache.from_model", "the same, 8 new tokens")
    assert all(any(line.startswith(name) and " p50 " in line for line in out.splitlines()) for name in systems), out


def test_head_budgets_timing_runs_both_caches_on_the_cpu(tmp_path: Path) -> None:
    """The smoke test of eval/gpu_head_budgets.py: both caches decode, and every layer's drawn split keeps its
    layer's pages within the option's bounds."""
    out = tmp_path / "r.json"
    run_script("gpu_head_budgets.py", "--device", "cpu", "--shape", "tiny-llama", "--context", "512", "--batch", "2",
               "--budget", "64", "--steps", "3", "--warmup", "2", "--rounds", "1", "--out", str(out))
    result = json.loads(out.read_text())
    assert set(result["rows"]) == {"uniform", "prompt"} and result["ratio_p50"] > 0
    shares = torch.tensor(result["shares"])  # [layers, heads] shares of K = 8
    assert shares.shape == (4, 4) and torch.allclose(shares.sum(dim=1), torch.full((4,), 4.0))
    assert bool((shares >= 0.25).all() and (shares <= 2).all()) and bool((shares != 1).any())


@pytest.mark.parametrize("online", [False, True])
def test_prefill_breakdown_runs_on_the_cpu(online: bool) -> None:
    """The smoke test of eval/gpu_prefill_breakdown.py: every part it wraps exists and is reached by a prefill."""
    out = run_script("gpu_prefill_breakdown.py", "--device", "cpu", "--shape", "tiny-llama", "--layers", "2",
                     "--context", "256", "--batch", "2", "--budget", "64", "--repeats", "1",
                     *(["--online-split", "--head-budgets", "prompt"] if online else ["--head-budgets", "uniform"]))
    calls = {line[:42].strip(): int(line.split()[-2]) for line in out.splitlines() if line.endswith(" calls")}
    layers = 2
    expected = {"principal axes": layers, "page metadata (min/max)": layers, "commit of the chunk": layers,
                "dense attention (sdpa)": layers, "online head split (no profile)": layers if online else 0,
                "page gains for head budgets": layers if online else 0}
    if not online:  # a random profile with both head classes in every layer (the online split may choose one)
        expected.update({"stable heads' host tier + tails": layers, "unstable heads' pages": layers})
    assert all(calls[name] == count for name, count in expected.items()), calls


def load_script(name: str) -> ModuleType:
    """An eval/ script imported as a module (its ``main`` not run)."""
    spec = importlib.util.spec_from_file_location(Path(name).stem, EVAL / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_scripts_reach_internals_that_exist() -> None:
    """What eval/gpu_step_profile.py and eval/gpu_kernel_sweep.py reach inside a cache, reached on a CPU cache after
    a prefill and a decode step: a rename there fails here, not only on a GPU host."""
    pytest.importorskip("triton")
    from flexicache import FlexiCache, attention, handoff
    from flexicache.backends import triton_select
    from flexicache.benchmarks.attention import Module, Shape, random_profile
    from flexicache.decode_paths import GraphedDecode

    shape = Shape(num_layers=1, num_kv_heads=2, group=2, head_dim=16)
    cache = FlexiCache(shape.config(), profile=random_profile(shape, 0.5), token_budget=32)
    layer, module = cache.layers[0], Module(0, shape)
    keys = torch.randn(1, shape.num_kv_heads, 40, shape.head_dim)
    layer.update(keys, keys)
    layer.commit(handoff.take(0), torch.randn(1, 4, 1, shape.head_dim), None)
    token = torch.randn(1, shape.num_kv_heads, 1, shape.head_dim)
    out_keys, out_values = layer.update(token, token)
    attention.flexicache_attention_forward(module, torch.randn(1, 4, 1, shape.head_dim), out_keys, out_values, None,
                                           scaling=module.scaling)

    store = cache.step_graphs  # gpu_step_profile.py times these methods by name
    assert all(callable(getattr(store, name)) for name in load_script("gpu_step_profile.py").BOOKKEEPING)
    assert store.eager_reason is None and not store.ready() and store.steps == {}

    storage, settings = layer.storage, layer.settings  # gpu_kernel_sweep.py
    assert layer.graphed is None and storage.pool.k.dtype == storage.dtype and storage.head_dim == shape.head_dim
    layout = cache.sequence.last_plan.decode_layout(storage.num_kv_heads, settings.pages_per_head)
    assert layout.row_indptr_host.numel() == storage.num_kv_heads + 1
    graphed = GraphedDecode(storage, layer.backend, layer.step_inputs)  # what a CUDA layer holds as layer.graphed
    assert graphed.graph is None and graphed.scale is None
    rows_query = torch.zeros(storage.num_kv_heads, shape.group, shape.head_dim)
    inputs = graphed.table_inputs(rows_query, cache.sequence.num_tokens)
    assert inputs.kmin is storage.meta.kmin and inputs.page_size == settings.page_size
    for name in ("score_unstable_pages", "list_pages", "selection_warps", "SCORE_BLOCK", "SCORE_WARPS", "TABLE_WARPS"):
        assert hasattr(triton_select, name), name


def test_accuracy_cost_reads_the_committed_runs(tmp_path: Path) -> None:
    """eval/accuracy_cost.py finds every setting it lists in the committed GPU and CPU results and draws them."""
    out = run_script("accuracy_cost.py", "--out", str(tmp_path / "accuracy_cost.png"))
    assert "| 8-token pages, every 2 steps |" in out
    assert "| 8-token pages, a quarter of K on standby (box scores alone) |" in out
    assert (tmp_path / "accuracy_cost.png").stat().st_size > 0
    table = out.split("\n\nwrote")[0].strip()
    assert table in (EVAL / "RESULTS.md").read_text(), (
        "eval/RESULTS.md's accuracy-cost table is out of date: python eval/accuracy_cost.py --update eval/RESULTS.md")


def test_exact_rescore_plot_reads_the_committed_runs(tmp_path: Path) -> None:
    """eval/exact_rescore_plot.py finds the rows of every model and budget it lists and draws them."""
    out = run_script("exact_rescore_plot.py", "--out", str(tmp_path / "exact_rescore.png"))
    assert out.count("exact_rescore 1.") == 7 and out.count("with K standby 1.") == 7
    assert "Qwen2.5-Coder-0.5B" in out
    assert (tmp_path / "exact_rescore.png").stat().st_size > 0


def test_head_budget_split_masks_keep_the_layer_budget() -> None:
    """eval/head_budget_split.py: the pooled mask attends to exactly H * K pages with every head's sink and tail, the
    ones of most mass; the prompt split gives a head of spread attention more pages than one whose attention sits on
    one key (they add recall there), H * K in all, at least 2 each."""
    script = load_script("head_budget_split.py")
    heads, group, page_size, pages, num_pages = 3, 2, 4, 4, 10
    weights = torch.full((heads, group, num_pages * page_size), 1e-3)
    weights[0, :, 8:28] = 1.0  # head 0 puts its mass on pages 2-6, head 2 on page 5 alone; head 1 is flat
    weights[2, :, 20:24] = 1.0
    mask = script.pooled_token_mask(weights, page_size, pages)
    chosen = mask.view(heads, num_pages, page_size).all(-1)
    whole_pages = bool((mask.view(heads, num_pages, page_size).any(-1) == chosen).all())
    assert int(chosen.sum()) == heads * pages and whole_pages
    assert bool(chosen[:, 0].all() and chosen[:, -1].all())
    assert chosen[0, 2:7].all() and chosen[2, 5] and int(chosen[1].sum()) == 2

    torch.manual_seed(0)
    keys = torch.randn(2, 80, 8)
    query = torch.randn(4, 80, 8) * 0.01  # KV head 0's query heads: flat attention
    query[2:] = keys[1, 40].expand(2, 80, 8) * 4  # KV head 1's: one key
    given = script.prompt_head_pages(query, keys, page_size=4, pages=5, window=16)
    assert int(given.sum()) == 10 and bool((given >= 2).all()) and int(given[0]) > int(given[1])
