"""Head-stability profiler: measure per-step top-K page sets, score temporal stability, classify heads.

``flexicache profile`` (see :mod:`flexicache.profiling.cli`) runs the whole pipeline; the pieces are:
:mod:`probe` (query-recording attention function), :mod:`pages` (page key min/max), :mod:`measure` (dense decoding
with top-K selection), :mod:`stability` (RCO and classification), :mod:`reports` (the paper's evidence),
:mod:`online` (estimate from the prompt at prefill), :mod:`data` (calibration data), :mod:`pipeline`, :mod:`plots`.
"""

from flexicache.profiling.measure import MeasureSettings, SampleTrace, trace_batch
from flexicache.profiling.online import (
    PromptEstimate,
    estimate_unstable_heads_from_prompt,
    online_agreement,
    prompt_stability,
)
from flexicache.profiling.pipeline import ClassifySettings, build_profile, measure_samples
from flexicache.profiling.stability import (
    Classification,
    classify_heads,
    random_corrected_overlap,
    rco_by_distance,
    stability_score,
)

__all__ = [
    "Classification",
    "ClassifySettings",
    "MeasureSettings",
    "PromptEstimate",
    "SampleTrace",
    "build_profile",
    "classify_heads",
    "estimate_unstable_heads_from_prompt",
    "measure_samples",
    "online_agreement",
    "prompt_stability",
    "random_corrected_overlap",
    "rco_by_distance",
    "stability_score",
    "trace_batch",
]
