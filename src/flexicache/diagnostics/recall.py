"""How much of the true attention a page selection keeps: recall of attention mass and output error per head.

For one decode step the true attention of every query head over all visible tokens is computed in float64 from a
:class:`~flexicache.diagnostics.trace.DecodeTrace`. A *selector* maps the step's grouped queries and keys to a
boolean token mask per (layer, KV head) row; the mass the mask holds (averaged over the GQA group) is its recall,
and attention restricted to the mask (renormalised, as sparse attention computes it) gives the output error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from flexicache.diagnostics.trace import DecodeTrace

Selector = Callable[["StepView"], torch.Tensor]
"""Maps a step to ``[R, T]`` bool: the tokens each (layer, KV head) row attends to."""


@dataclass
class StepView:
    """One decode step in rows ``r = layer * H + head``: ``query [R, G, D]``, ``keys``/``values`` ``[R, T, D]``
    (float64), ``weights [R, G, T]`` the true attention (float64); the first ``prompt_tokens`` keys were the
    prefill (a cache takes its principal axes from them)."""

    query: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    weights: torch.Tensor
    prompt_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[1]


def step_view(trace: DecodeTrace, step: int) -> StepView:
    """The rows of decode step ``step`` with their true attention."""
    num_layers, num_heads, _, head_dim = trace.keys.shape
    context = trace.context(step)
    keys = trace.keys[:, :, :context].double().reshape(num_layers * num_heads, context, head_dim)
    values = trace.values[:, :, :context].double().reshape(num_layers * num_heads, context, head_dim)
    query = trace.queries[step].double()  # [L, Hq, D]
    group = query.shape[1] // num_heads
    query = query.reshape(num_layers * num_heads, group, head_dim)
    scale = torch.tensor(trace.scaling, dtype=torch.float64).repeat_interleave(num_heads).view(-1, 1, 1)
    weights = torch.softmax(torch.bmm(query, keys.transpose(1, 2)) * scale, dim=-1)
    return StepView(query * scale, keys, values, weights, trace.prefill)


@dataclass
class StepScores:
    """Per row ``[R]``: ``recall`` (mass kept, mean over the group), ``output_error`` (relative L2 error of the
    attention output, mean over the group) and ``tokens`` (how many tokens the mask holds)."""

    recall: torch.Tensor
    output_error: torch.Tensor
    tokens: torch.Tensor


def score_mask(view: StepView, mask: torch.Tensor) -> StepScores:
    """Recall and output error of attending to ``mask [R, T]`` instead of every token."""
    weights = view.weights
    kept = weights * mask.unsqueeze(1)
    mass = kept.sum(-1)  # [R, G]
    dense = torch.bmm(weights, view.values)
    sparse = torch.bmm(kept / mass.clamp(min=1e-300).unsqueeze(-1), view.values)
    error = (sparse - dense).norm(dim=-1) / dense.norm(dim=-1).clamp(min=1e-300)
    return StepScores(mass.mean(1), error.mean(1), mask.sum(-1))


def evaluate(trace: DecodeTrace, selectors: Mapping[str, Selector], steps: list[int] | None = None,
             progress: bool = False) -> dict[str, StepScores]:
    """Mean over ``steps`` (default: all) of every selector's per-row scores, ``[L * H]`` each."""
    steps = list(range(trace.num_steps)) if steps is None else steps
    totals: dict[str, list[torch.Tensor]] = {name: [] for name in selectors}
    for step in tqdm(steps, desc="steps", disable=not progress, leave=False):
        view = step_view(trace, step)
        for name, select in selectors.items():
            scores = score_mask(view, select(view))
            totals[name].append(torch.stack([scores.recall, scores.output_error, scores.tokens.double()]))
    result = {}
    for name, rows in totals.items():
        mean = torch.stack(rows).mean(0)
        result[name] = StepScores(mean[0], mean[1], mean[2])
    return result
