"""Recall and output error of page selections over a budget sweep, as JSON and PNG plots.

For every budget: FlexiCache's selection with the given settings, the same refined by the true mass of twice as
many candidate pages (:func:`~flexicache.diagnostics.selectors.refined`), Quest's bound (``spread_weight=1`` in the
model's axes) with the same page size, the oracle pages and the oracle tokens; per (layer, KV head) the mean over the
traced steps of the attention mass kept (recall) and of the attention output's relative error.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from flexicache.config import FlexiCacheConfig
from flexicache.diagnostics import selectors
from flexicache.diagnostics.recall import Selector, StepScores, evaluate
from flexicache.diagnostics.trace import DecodeTrace
from flexicache.plotting import pyplot


def selections(settings: FlexiCacheConfig) -> dict[str, Selector]:
    """The selections compared at ``settings.token_budget``."""
    budget, page_size = settings.token_budget, settings.page_size
    return {
        "flexicache": selectors.flexicache(settings),
        "refined_2x": selectors.refined(settings, candidates=2),
        "quest": selectors.flexicache(dataclasses.replace(settings, spread_weight=1.0, principal_bounds=False)),
        "oracle_pages": selectors.oracle_pages(budget, page_size),
        "oracle_tokens": selectors.oracle_tokens(budget),
    }


def diagnose(trace: DecodeTrace, settings: FlexiCacheConfig, budgets: Sequence[int], steps: Sequence[int],
             progress: bool = True) -> dict[str, Any]:
    """``{"budgets": {budget: {selection: scores}}}`` with per-row scores as ``[L][H]`` lists (see
    :func:`summarize`)."""
    num_layers, num_heads = trace.keys.shape[:2]
    result: dict[str, Any] = {"num_layers": num_layers, "layers": trace.layers, "num_kv_heads": num_heads,
                              "steps": list(steps),
                              "prefill": trace.prefill, "settings": dataclasses.asdict(settings), "budgets": {}}
    for budget in tqdm(budgets, desc="budgets", disable=not progress):
        scores = evaluate(trace, selections(dataclasses.replace(settings, token_budget=budget)), list(steps),
                          progress)
        result["budgets"][str(budget)] = {name: summarize(score, num_layers, num_heads)
                                          for name, score in scores.items()}
    return result


def summarize(scores: StepScores, num_layers: int, num_heads: int) -> dict[str, Any]:
    """Means and ``[L][H]`` grids of one selection's recall and output error."""
    recall, error = scores.recall.view(num_layers, num_heads), scores.output_error.view(num_layers, num_heads)
    return {"recall": float(recall.mean()), "output_error": float(error.mean()), "min_recall": float(recall.min()),
            "recall_by_head": recall.tolist(), "output_error_by_head": error.tolist(),
            "tokens": float(scores.tokens.mean())}


def write(result: dict[str, Any], out: str | Path) -> list[Path]:
    """``diagnosis.json`` and, with matplotlib, ``recall_by_head.png`` and ``recall_vs_budget.png`` in ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "diagnosis.json"]
    paths[0].write_text(json.dumps(result, indent=1))
    try:
        plt = pyplot()
    except ImportError:
        return paths
    budgets = sorted(result["budgets"], key=int)
    first = result["budgets"][budgets[0]]
    names = ("flexicache", "quest", "oracle_pages")
    figure, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 5), sharey=True)
    for axis, name in zip(axes, names):
        image = axis.imshow(first[name]["recall_by_head"], aspect="auto", vmin=0, vmax=1, cmap="viridis")
        axis.set_title(f"{name} @ {budgets[0]}: {first[name]['recall']:.3f}")
        axis.set_xlabel("KV head")
    axes[0].set_ylabel("layer")
    figure.colorbar(image, ax=axes, label="attention mass kept (recall)")
    paths.append(out / "recall_by_head.png")
    figure.savefig(paths[-1], dpi=100)
    plt.close(figure)
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("flexicache", "refined_2x", "quest", "oracle_pages", "oracle_tokens"):
        left.plot([int(b) for b in budgets], [result["budgets"][b][name]["recall"] for b in budgets], "o-",
                  label=name)
        right.plot([int(b) for b in budgets], [result["budgets"][b][name]["output_error"] for b in budgets], "o-",
                   label=name)
    for axis, label in ((left, "mean recall"), (right, "mean relative output error")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("token budget")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    left.legend()
    figure.tight_layout()
    paths.append(out / "recall_vs_budget.png")
    figure.savefig(paths[-1], dpi=100)
    plt.close(figure)
    return paths


def format_table(result: dict[str, Any]) -> str:
    """A markdown table: one row per budget, recall / output error of each selection."""
    names = ("flexicache", "refined_2x", "quest", "oracle_pages", "oracle_tokens")
    lines = ["| budget | " + " | ".join(f"{name} recall / error" for name in names) + " |",
             "|---" * (len(names) + 1) + "|"]
    for budget in sorted(result["budgets"], key=int):
        row = result["budgets"][budget]
        lines.append(f"| {budget} | " + " | ".join(
            f"{row[name]['recall']:.4f} / {row[name]['output_error']:.4f}" for name in names) + " |")
    return "\n".join(lines)
