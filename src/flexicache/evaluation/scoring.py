"""Scoring through the package's own ``evaluate`` modules, which need no network.

The modules live in ``metric_modules/<name>/<name>.py`` (``longbench``, ``ruler``, ``leval``) and wrap the
functions of :mod:`flexicache.evaluation.metrics`; ``evaluate.load(module_path(name), config)`` loads one.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .tasks import Sample

MODULES_DIR = Path(__file__).resolve().parent / "metric_modules"
MODULE_NAMES = ("longbench", "ruler", "leval")


def module_path(name: str) -> str:
    """Folder of the package's ``evaluate`` module ``name``: what ``evaluate.load`` takes."""
    if name not in MODULE_NAMES:
        raise KeyError(f"no evaluate module {name!r} in flexicache; have {MODULE_NAMES}")
    return str(MODULES_DIR / name)


@functools.cache
def load_module(name: str, config: str | None = None) -> Any:
    """The loaded ``evaluate`` module (once per process), kept in memory: nothing is written beside the data."""
    import evaluate

    return evaluate.load(module_path(name), config, keep_in_memory=True)


@dataclass(frozen=True)
class EvaluateMetric:
    """A task's metric: one of the package's ``evaluate`` modules with its config.

    ``inputs`` names the extra input columns the module takes, read from each sample's ``meta`` (None -> []).
    """

    module: str
    config: str | None = None
    inputs: tuple[str, ...] = ()

    def score(self, predictions: Sequence[str], samples: Sequence[Sample]) -> dict[str, list[float]]:
        """Per-sample scores in [0, 1] by metric name, headline metric first ({} for no predictions)."""
        if not predictions:
            return {}
        extra = {name: [sample.meta.get(name) or [] for sample in samples] for name in self.inputs}
        result = load_module(self.module, self.config).compute(
            predictions=list(predictions), references=[list(sample.answers) for sample in samples], **extra)
        return result["per_sample"]
