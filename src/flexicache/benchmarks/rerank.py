"""Attention-layer cases: the dense-FlashInfer comparison of :mod:`flexicache.benchmarks.attention` (CUDA), and the
rerank ablation (any device).

Rerank ablation, one FlexiCache per schedule on the same random keys/values and queries, attention layers only:
- ``no_rerank``: every head stable, never reranked after the prefill (append + sparse attention only: the floor);
- ``stability_aware``: the profile (``--unstable-fraction`` of each layer's heads unstable, every step; the stable
  ones every ``--rerank-interval`` steps, promoting from the host tier);
- ``every_step``: the same profile, every head every step (stable heads promote from the host every step);
- ``quest_like``: every head unstable: all pages on the device, every head every step, no transfers.

Rerank time of a schedule (scoring + selection + transfers, amortised per step) = its MEAN step time minus
``no_rerank``'s mean, all four measured in one run over the same number of timed steps, a multiple of
``--rerank-interval`` (stable reranks are staggered by layer: every window of ``k * interval`` steps holds exactly
``k`` reranks of each layer). The median step would miss them: with 4 layers and interval 16, 48 of every 64
stability-aware steps hold no stable rerank. The paper reports every-head-every-step reranking 2.44x the time of
the stability-aware schedule. ``quest_like`` has no host tier (its steps skip the floor's host-tier work), so it
gets no rerank time over this floor, only its step time.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch

from flexicache import HeadProfile
from flexicache.benchmarks.attention import Shape, bench_flexicache, random_profile, run_attention_benchmark
from flexicache.benchmarks.suite import CaseResult, Suite, cache_options, model_config

NEVER = 10**9  # a rerank interval no run reaches


def shape_of(model_name: str, layers: int) -> Shape:
    return Shape.of(model_config(model_name, layers))


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
                                         shape, s.unstable_fraction, s.layer_steps, s.warmup, s.seed, cache_options(s)))


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
    steps = timed_steps(s.layer_steps, s.rerank_interval)
    queries = correlated_queries(s.warmup + steps, batch, shape, s.query_correlation, suite.device,
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
                                             steps, s.warmup, interval, cache_options(s)))


def timed_steps(layer_steps: int, rerank_interval: int) -> int:
    """``layer_steps`` rounded up to a multiple of the rerank interval (whole rerank periods in every window)."""
    return rerank_interval * max(1, math.ceil(layer_steps / rerank_interval))


def rerank_summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per schedule: step times, rerank time (mean step over ``no_rerank``'s mean; ``None`` when the rows have no
    mean, as in runs before it was recorded, and for ``quest_like``), the p50 step's excess over ``no_rerank``'s
    p50 (NOT the rerank time: the median step of a schedule with periodic reranks holds none), reranked rows,
    promoted fraction, host-to-device bytes; ratios to the stability-aware schedule."""
    by_name = {row["schedule"]: row for row in rows if "schedule" in row}
    floor = by_name.get("no_rerank", {})
    summary: dict[str, dict[str, Any]] = {}
    for name, row in by_name.items():
        window, steps = row["window"], max(1, row["window"]["decode_steps"])
        stable_rows = window["reranks_stable"]
        # a stable rerank fills K - 1 + C working-set slots (rows recorded before standby pages: C = 0)
        selection_slots = stable_rows * (row["pages_per_head"] - 1 + row.get("standby_pages", 0))
        comparable = name != "quest_like"  # shares the floor's host-tier path
        mean, floor_mean = row.get("step_ms_mean"), floor.get("step_ms_mean")
        summary[name] = {
            "step_ms_p50": row["step_ms_p50"],
            "step_ms_mean": mean,
            "host_issue_ms_p50": row["host_issue_ms_p50"],
            "rerank_ms": mean - floor_mean if comparable and mean is not None and floor_mean is not None else None,
            "p50_excess_ms": (row["step_ms_p50"] - floor["step_ms_p50"]
                              if comparable and "step_ms_p50" in floor else None),
            "reranked_rows_per_step": (stable_rows + window["reranks_unstable"]) / steps,
            "promoted_fraction": window["promoted_pages"] / selection_slots if selection_slots else None,
            "h2d_bytes_per_stable_rerank_row": window["bytes_h2d"] / stable_rows if stable_rows else None,
            "h2d_bytes_per_step": window["bytes_h2d"] / steps,
            "timed_steps": window["decode_steps"],
        }
    aware = summary.get("stability_aware")
    if aware is not None:
        for name in ("every_step", "quest_like"):
            if name not in summary:
                continue
            item = summary[name]
            item["rerank_time_vs_stability_aware"] = (
                item["rerank_ms"] / aware["rerank_ms"] if item["rerank_ms"] is not None
                and aware["rerank_ms"] is not None and aware["rerank_ms"] > 0 else None)
            item["rows_vs_stability_aware"] = (item["reranked_rows_per_step"] / aware["reranked_rows_per_step"]
                                               if aware["reranked_rows_per_step"] else None)
            item["mean_step_vs_stability_aware"] = (item["step_ms_mean"] / aware["step_ms_mean"]
                                                    if item["step_ms_mean"] and aware["step_ms_mean"] else None)
            item["p50_step_vs_stability_aware"] = item["step_ms_p50"] / aware["step_ms_p50"]
    return summary
