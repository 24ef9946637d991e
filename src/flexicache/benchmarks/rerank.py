"""Attention-layer cases: the dense-FlashInfer comparison of :mod:`flexicache.benchmarks.attention` (CUDA), and the
rerank ablation (any device).

Rerank ablation, one FlexiCache per schedule on the same random keys/values and queries, attention layers only:
- ``no_rerank``: every head stable, never reranked after the prefill (append + sparse attention only: the floor);
- ``stability_aware``: the profile (``--unstable-fraction`` of each layer's heads unstable, every step; the stable
  ones every ``--rerank-interval`` steps, promoting from the host tier);
- ``every_step``: the same profile, every head every step (stable heads promote from the host every step);
- ``quest_like``: every head unstable: all pages on the device, every head every step, no transfers.
Rerank cost of a schedule = its step time minus ``no_rerank``'s; the paper reports every-head-every-step reranking
2.44x costlier than the stability-aware schedule.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch

from flexicache import HeadProfile
from flexicache.benchmarks.attention import Shape, bench_flexicache, random_profile, run_attention_benchmark
from flexicache.benchmarks.suite import CaseResult, Suite, model_config

NEVER = 10**9  # a rerank interval no run reaches


def shape_of(model_name: str, layers: int) -> Shape:
    config = model_config(model_name, layers)
    return Shape(layers, config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads,
                 config.head_dim)


def run_attention(suite: Suite, model_name: str, result: CaseResult) -> None:
    """Dense FlashInfer vs FlexiCache vs Quest-like vs DynamicCache+sdpa, attention layers only (CUDA + FlashInfer)."""
    from flexicache.backends.flashinfer import flashinfer_available

    s = suite.settings
    label = {"model": model_name, "batch": s.attention_batch, "context": s.attention_context, "budget": s.budget}
    if suite.device.type != "cuda" or not flashinfer_available():
        result.skipped.append(dict(label, reason="needs CUDA and FlashInfer (the dense FlashInfer baseline)"))
        return
    shape = shape_of(model_name, s.layers)
    suite.attempt(result, label, partial(run_attention_benchmark, s.attention_batch, s.attention_context, s.budget,
                                         shape, s.unstable_fraction, s.layer_steps, s.warmup, s.seed))


def correlated_queries(count: int, batch: int, shape: Shape, correlation: float, device: torch.device,
                       dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """``count`` queries ``[B, Hq, 1, D]``, each ``correlation * previous + sqrt(1 - correlation**2) * noise``."""
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    size = (batch, shape.num_kv_heads * shape.group, 1, shape.head_dim)
    query = torch.randn(size, generator=generator, device=device)
    queries = [query.to(dtype)]
    for _ in range(count - 1):
        noise = torch.randn(size, generator=generator, device=device)
        query = correlation * query + math.sqrt(1 - correlation**2) * noise
        queries.append(query.to(dtype))
    return queries


def run(suite: Suite, model_name: str, result: CaseResult) -> None:
    """The rerank ablation at ``--attention-batch``, ``--attention-context``, ``--budget``."""
    s = suite.settings
    shape = shape_of(model_name, s.layers)
    batch, context = s.attention_batch, s.attention_context
    generator = torch.Generator(device=suite.device).manual_seed(s.seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=generator, device=suite.device, dtype=suite.dtype)

    kv_shape = (batch, shape.num_kv_heads, context, shape.head_dim)
    prompt = [(randn(*kv_shape), randn(*kv_shape)) for _ in range(shape.num_layers)]
    new_tokens = [(randn(batch, shape.num_kv_heads, 1, shape.head_dim), randn(batch, shape.num_kv_heads, 1,
                                                                             shape.head_dim)) for _ in range(8)]
    queries = correlated_queries(s.warmup + s.layer_steps, batch, shape, s.query_correlation, suite.device,
                                 suite.dtype, s.seed)
    every_head = [(layer, head) for layer in range(shape.num_layers) for head in range(shape.num_kv_heads)]
    profiled = random_profile(shape, s.unstable_fraction, s.seed)
    schedules: list[tuple[str, HeadProfile, int]] = [
        ("no_rerank", HeadProfile(shape.num_layers, shape.num_kv_heads, shape.head_dim, []), NEVER),
        ("stability_aware", profiled, s.rerank_interval),
        ("every_step", profiled, 1),
        ("quest_like", HeadProfile(shape.num_layers, shape.num_kv_heads, shape.head_dim, every_head), 1),
    ]
    for name, profile, interval in schedules:
        label = {"model": model_name, "schedule": name, "batch": batch, "context": context, "budget": s.budget,
                 "layers": shape.num_layers, "query_correlation": s.query_correlation}
        suite.attempt(result, label, partial(bench_flexicache, shape, prompt, new_tokens, queries, profile, s.budget,
                                             s.layer_steps, s.warmup, interval, s.backend))


def rerank_summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per schedule: rerank cost (ms over ``no_rerank``), reranked rows, promoted fraction, host-to-device bytes."""
    by_name = {row["schedule"]: row for row in rows if "schedule" in row}
    floor = by_name.get("no_rerank", {}).get("step_ms_p50")
    summary = {}
    for name, row in by_name.items():
        window, steps = row["window"], max(1, row["window"]["decode_steps"])
        stable_rows = window["reranks_stable"]
        selection_slots = stable_rows * (row["pages_per_head"] - 1)
        summary[name] = {
            "step_ms_p50": row["step_ms_p50"],
            "host_issue_ms_p50": row["host_issue_ms_p50"],
            "rerank_ms": None if floor is None else row["step_ms_p50"] - floor,
            "reranked_rows_per_step": (stable_rows + window["reranks_unstable"]) / steps,
            "promoted_fraction": window["promoted_pages"] / selection_slots if selection_slots else None,
            "h2d_bytes_per_stable_rerank_row": window["bytes_h2d"] / stable_rows if stable_rows else None,
            "h2d_bytes_per_step": window["bytes_h2d"] / steps,
        }
    aware = summary.get("stability_aware", {}).get("rerank_ms")
    for name in ("every_step", "quest_like"):
        if name in summary and aware is not None and aware > 0:
            summary[name]["rerank_cost_vs_stability_aware"] = (summary[name]["rerank_ms"] or 0.0) / aware
            summary[name]["step_time_vs_stability_aware"] = (summary[name]["step_ms_p50"]
                                                             / summary["stability_aware"]["step_ms_p50"])
    return summary
