"""From calibration samples to a :class:`HeadProfile`: measure, score, classify, report."""

from __future__ import annotations

import platform
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
import transformers
from tqdm.auto import tqdm

from flexicache.config import DEFAULT_UNSTABLE_FRACTION
from flexicache.hybrid import sparse_layers, text_config_of
from flexicache.profile import HeadProfile, model_shape
from flexicache.profiling.data import CalibrationSample, EncodedSample, encode_sample
from flexicache.profiling.measure import MeasureSettings, SampleTrace, trace_batch
from flexicache.profiling.online import online_agreement
from flexicache.profiling.reports import (
    cross_task_agreement,
    promoted_fraction,
    rco_curves,
    selection_agreement,
    set_overlap,
)
from flexicache.profiling.stability import classify_heads, rco_by_distance, stability_score


@dataclass
class ClassifySettings:
    fraction: float = DEFAULT_UNSTABLE_FRACTION  # share of all heads classified unstable
    quantile: float = 0.25  # per sample, the bottom share of heads counted as unstable
    rerank_interval: int = 16  # stable heads' rerank period, for the promoted-fraction report


def _usable(sample: EncodedSample, settings: MeasureSettings) -> bool:
    """Whether a sample can be traced (full continuation) and compared (more pages than K at some step)."""
    if sample.continuation_ids is not None and sample.continuation_ids.numel() < settings.steps:
        return False
    pages_before_last_step = -(-(sample.prompt_ids.numel() + settings.steps - 1) // settings.page_size)
    return pages_before_last_step > settings.k


def measure_samples(
    model: torch.nn.Module,
    tokenizer: Any,
    samples: Sequence[CalibrationSample],
    settings: MeasureSettings,
    prompt_tokens: int,
    batch_size: int = 1,
    progress: bool = True,
) -> list[SampleTrace]:
    """Encode the samples and trace them in batches of equal prompt length (no padding needed)."""
    encoded = [encode_sample(sample, tokenizer, prompt_tokens, settings.steps) for sample in samples]
    usable = [sample for sample in encoded if _usable(sample, settings)]
    if len(usable) < len(encoded):
        warnings.warn(
            f"Skipped {len(encoded) - len(usable)} calibration sample(s): too short for {settings.steps} steps with "
            f"more than K={settings.k} pages; give longer prompts or a smaller budget.",
            stacklevel=2,
        )
    if not usable:
        raise ValueError("No usable calibration sample: prompts must span more than token_budget tokens.")
    groups: dict[tuple[int, bool], list[EncodedSample]] = {}
    for sample in usable:
        groups.setdefault((sample.prompt_ids.numel(), sample.continuation_ids is None), []).append(sample)
    traces: list[SampleTrace] = []
    with tqdm(total=len(usable) * settings.steps, unit="step", desc="profiling", disable=not progress) as bar:
        for members in groups.values():
            for start in range(0, len(members), batch_size):
                batch = members[start : start + batch_size]
                continuation = (
                    None if batch[0].continuation_ids is None
                    else torch.stack([s.continuation_ids[: settings.steps] for s in batch])
                )
                bar.set_postfix(task=",".join(sorted({s.task for s in batch})))
                traces += trace_batch(
                    model, torch.stack([s.prompt_ids for s in batch]), settings, continuation,
                    tasks=[s.task for s in batch], on_step=partial(bar.update, len(batch)),
                )
    return traces


def sample_curves(traces: Sequence[SampleTrace], settings: MeasureSettings, attention: bool = False) -> torch.Tensor:
    """RCO versus distance of every sample: ``[N, max_distance, L, H]`` (quest sets, or attention-mass sets)."""
    return torch.stack([
        rco_by_distance(trace.attention_pages if attention else trace.pages, trace.num_pages, settings.k,
                        settings.max_distance)[0]
        for trace in traces
    ])


def _model_info(config: Any, extra: dict[str, Any]) -> dict[str, Any]:
    text_config = text_config_of(config)
    info = {
        "model_type": getattr(text_config, "model_type", None),
        "architectures": getattr(config, "architectures", None),
        "num_attention_heads": text_config.num_attention_heads,
        "hidden_size": text_config.hidden_size,
        "max_position_embeddings": getattr(text_config, "max_position_embeddings", None),
        "dtype": str(getattr(config, "dtype", None) or ""),
    }
    return {**info, **extra}


def _per_model_layer(rows: list[Any], traced: list[int], num_layers: int) -> list[Any]:
    """Rows of the traced layers placed at their model layer index, ``None`` at the others."""
    placed: list[Any] = [None] * num_layers
    for layer, row in zip(traced, rows, strict=True):
        placed[layer] = row
    return placed


def build_profile(
    config: Any,
    traces: Sequence[SampleTrace],
    settings: MeasureSettings,
    classify: ClassifySettings,
    model_name: str = "",
    model_info: dict[str, Any] | None = None,
    calibration: dict[str, Any] | None = None,
) -> HeadProfile:
    """Classify heads from the traces and assemble the profile, with every report in ``calibration["reports"]``.

    The traces hold the sparse paged layers of the model (:func:`~flexicache.hybrid.sparse_layers`), the reports are
    computed over them, and the profile names them by their model layer index. ``calibration`` (data description,
    command, ...) is merged into the profile's calibration dict.
    """
    num_layers, num_kv_heads, head_dim = model_shape(config)
    traced = sparse_layers(config)
    curves = sample_curves(traces, settings)
    sample_scores = torch.stack([stability_score(curve) for curve in curves])  # [N, traced layers, H]
    if sample_scores.shape[1:] != (len(traced), num_kv_heads):
        raise ValueError(f"traces have {tuple(sample_scores.shape[1:])} heads, the config's sparse paged layers "
                         f"{len(traced)}x{num_kv_heads}")
    result = classify_heads(sample_scores, classify.fraction, classify.quantile)
    unstable = [(traced[row], head) for row, head in result.unstable]  # model layer indices, most unstable first
    mask = result.unstable_mask()
    tasks = [trace.task for trace in traces]
    reports: dict[str, Any] = {
        "cross_task_agreement": cross_task_agreement(
            sample_scores, tasks, classify.fraction, classify.quantile, reference=result.unstable
        ),
        "promoted_fraction": promoted_fraction(
            [(t.pages, t.num_pages) for t in traces], mask, settings.k, classify.rerank_interval
        ),
        "rco_vs_distance": rco_curves(curves, mask),
    }
    if all(trace.attention_pages is not None for trace in traces):
        attention_scores = torch.stack([stability_score(c) for c in sample_curves(traces, settings, attention=True)])
        reports["attention_mass"] = {
            "topk_overlap": selection_agreement(
                [(t.pages, t.num_pages) for t in traces], [t.attention_pages for t in traces], settings.k
            ),
            "unstable_set_overlap": set_overlap(
                classify_heads(attention_scores, classify.fraction, classify.quantile).unstable, result.unstable
            ),
        }
    scores = _per_model_layer([[round(float(v), 6) for v in row] for row in result.scores], traced, num_layers)
    profile = HeadProfile(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        unstable_heads=unstable,
        model=model_name,
        page_size=settings.page_size,
        token_budget=settings.token_budget,
        unstable_fraction=classify.fraction,
        scores=scores,
        model_info=_model_info(config, model_info or {}),
        sparse_layers=None if len(traced) == num_layers else traced,
    )
    estimates = [trace.prompt_estimate for trace in traces]
    if all(estimate is not None for estimate in estimates) and result.unstable:
        reports["online_estimate"] = online_agreement(torch.stack(estimates), profile)
    names = sorted(set(tasks))
    profile.calibration = {
        **(calibration or {}),
        "samples": {name: tasks.count(name) for name in names},
        "prompt_tokens": {name: sorted({t.prompt_tokens for t in traces if t.task == name}) for name in names},
        "settings": {**asdict(settings), **asdict(classify), "k": settings.k},
        "bottom_quantile_counts": _per_model_layer(result.bottom_counts.tolist(), traced, num_layers),
        "unstable_order": [list(pair) for pair in unstable],
        "reports": reports,
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }
    return profile
