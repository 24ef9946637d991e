"""The paper's evidence, recomputed from measured top-K sets: cross-task agreement of the unstable sets, the
fraction of the top-K newly promoted at a periodic rerank, and RCO versus step distance for stable / unstable heads.
All results are plain JSON-ready dicts (they go into ``HeadProfile.calibration["reports"]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations
from typing import Any

import torch

from flexicache.config import DEFAULT_UNSTABLE_FRACTION
from flexicache.profiling.stability import classify_heads, lowest_count, overlap_counts


def set_overlap(a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]) -> float:
    """``|a ∩ b| / max(|a|, |b|)`` of two head sets (1.0 when both are empty)."""
    size = max(len(a), len(b))
    return len(set(a) & set(b)) / size if size else 1.0


def cross_task_agreement(
    sample_scores: torch.Tensor, tasks: Sequence[str], fraction: float = DEFAULT_UNSTABLE_FRACTION,
    quantile: float = 0.25, reference: Sequence[tuple[int, int]] | None = None,
) -> dict[str, Any]:
    """Pairwise intersection ratio of the unstable sets classified from each task's samples alone.

    Args:
        sample_scores: ``[N, L, H]`` per-sample stability scores; ``tasks[i]`` is sample ``i``'s task.
        reference: the unstable set from all samples, to report each task's agreement with it.
    """
    names = sorted(set(tasks))
    per_task = {
        name: classify_heads(sample_scores[[i for i, t in enumerate(tasks) if t == name]], fraction, quantile).unstable
        for name in names
    }
    matrix = [[set_overlap(per_task[a], per_task[b]) for b in names] for a in names]
    pairs = [set_overlap(per_task[a], per_task[b]) for a, b in combinations(names, 2)]
    total = sample_scores[0].numel()
    result: dict[str, Any] = {
        "tasks": names,
        "samples": {name: sum(t == name for t in tasks) for name in names},
        "matrix": matrix,
        "mean": sum(pairs) / len(pairs) if pairs else None,
        "min": min(pairs) if pairs else None,
        "max": max(pairs) if pairs else None,
        "random_baseline": lowest_count(total, fraction) / total,
    }
    if reference is not None:
        result["vs_all_samples"] = {name: set_overlap(per_task[name], reference) for name in names}
    return result


def promoted_fraction(
    traces: Sequence[tuple[torch.Tensor, torch.Tensor]], unstable_mask: torch.Tensor, k: int, interval: int = 16
) -> dict[str, Any]:
    """Fraction of the top-K set that is new at a rerank every ``interval`` steps (the pages a stable head fetches).

    Args:
        traces: per sample ``(pages [S, L, H, K], num_pages [S])``.
        unstable_mask: ``[L, H]`` bool.

    Returns ``promoted`` (new members / K) and ``promoted_old_pages`` (new members that were already full pages at
    the previous rerank, i.e. certainly not the tail written since: a lower bound on host-to-device fetches), each
    averaged over reranks and then over the stable, the unstable and all heads.
    """
    new_sum = torch.zeros(unstable_mask.shape, dtype=torch.float64)
    old_sum = torch.zeros_like(new_sum)
    reranks = 0
    for pages, num_pages in traces:
        for step in range(interval, pages.shape[0], interval):
            before, after, count_before = pages[step - interval], pages[step], int(num_pages[step - interval])
            if count_before <= k:
                continue
            new_sum += k - overlap_counts(before, after)
            old_after = after.masked_fill(after >= count_before - 1, -1)  # pages that existed and were full before
            old_sum += (old_after >= 0).sum(dim=-1) - overlap_counts(before, old_after)
            reranks += 1
    if reranks == 0:
        return {"interval": interval, "reranks": 0}

    def by_group(total: torch.Tensor) -> dict[str, float | None]:
        per_head = total / (reranks * k)
        groups = {"stable": ~unstable_mask, "unstable": unstable_mask, "all": torch.ones_like(unstable_mask)}
        return {name: float(per_head[mask].mean()) if mask.any() else None for name, mask in groups.items()}

    return {
        "interval": interval,
        "reranks": reranks,
        "promoted": by_group(new_sum),
        "promoted_old_pages": by_group(old_sum),
    }


def rco_curves(curves: torch.Tensor, unstable_mask: torch.Tensor) -> dict[str, Any]:
    """RCO versus step distance: ``curves [N, D, L, H]`` -> mean and spread over the stable / unstable heads."""
    per_head = curves.nanmean(dim=0)  # [D, L, H]
    result: dict[str, Any] = {"distance": list(range(1, curves.shape[1] + 1))}
    for name, mask in (("stable", ~unstable_mask), ("unstable", unstable_mask)):
        if mask.any():
            values = per_head[:, mask]  # [D, heads in group]
            result[f"{name}_mean"] = values.nanmean(dim=1).tolist()
            result[f"{name}_std"] = values.std(dim=1).nan_to_num(nan=0.0).tolist()
    return result


def selection_agreement(
    quest_pages: Sequence[tuple[torch.Tensor, torch.Tensor]], attention_pages: Sequence[torch.Tensor], k: int
) -> float:
    """Mean ``|quest ∩ attention| / K`` of the two top-K rankings over steps with ``N > K``, heads and samples."""
    total, count = 0.0, 0
    for (quest, num_pages), attention in zip(quest_pages, attention_pages, strict=True):
        valid = num_pages > k
        if valid.any():
            total += float(overlap_counts(quest[valid], attention[valid]).to(torch.float64).mean()) / k
            count += 1
    return total / count if count else float("nan")


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def format_reports(reports: dict[str, Any]) -> str:
    """Human-readable summary of the reports dict built by the profiler."""
    lines = []
    agreement = reports.get("cross_task_agreement")
    if agreement:
        lines.append(
            f"cross-task agreement of unstable sets ({len(agreement['tasks'])} tasks): mean {_fmt(agreement['mean'])}, "
            f"min {_fmt(agreement['min'])}, max {_fmt(agreement['max'])} "
            f"(chance {_fmt(agreement['random_baseline'])}; paper 0.76-0.83)"
        )
        for name, row in zip(agreement["tasks"], agreement["matrix"], strict=True):
            lines.append(f"  {name:>12}: " + " ".join(f"{value:.2f}" for value in row))
    promoted = reports.get("promoted_fraction")
    if promoted and promoted.get("reranks"):
        new, old = promoted["promoted"], promoted["promoted_old_pages"]
        lines.append(
            f"newly promoted at a {promoted['interval']}-step rerank: stable heads {_fmt(new['stable'])} of K "
            f"(old pages only {_fmt(old['stable'])}), unstable {_fmt(new['unstable'])} (paper 0.23-0.35)"
        )
    curves = reports.get("rco_vs_distance")
    if curves and "stable_mean" in curves and "unstable_mean" in curves:
        for name in ("stable", "unstable"):
            values = curves[f"{name}_mean"]
            lines.append(f"RCO {name:>8} heads, d=1/4/16: " + " / ".join(
                _fmt(values[d - 1]) for d in (1, 4, 16) if d <= len(values)))
    online = reports.get("online_estimate")
    if online:
        lines.append(
            f"prompt-tail estimate vs profile: per-request overlap {_fmt(online['per_request_overlap'])}, "
            f"mean-estimate overlap {_fmt(online['mean_estimate_overlap'])}, "
            f"Spearman {_fmt(online.get('spearman_vs_profile_scores'))} (chance {_fmt(online['random_baseline'])})"
        )
    attention = reports.get("attention_mass")
    if attention:
        lines.append(
            f"Quest vs attention-mass top-K overlap {_fmt(attention['topk_overlap'])}; unstable sets agree "
            f"{_fmt(attention['unstable_set_overlap'])}"
        )
    return "\n".join(lines)
