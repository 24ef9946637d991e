"""The harness's data model: a sample is a tokenised prompt with its references, a task a list of samples
with one way to score them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol


@dataclass
class Sample:
    """One prompt, ready to run.

    ``input_ids`` is the full model input (chat template and answer prefix included); ``answers`` the
    references (empty for reference-free tasks); ``meta`` holds what scoring or reporting needs
    (LongBench's ``length``, ``all_classes``, ...). ``stop_at_newline`` adds the newline token to the stop
    tokens and forbids stopping at the first step (LongBench's samsum rule); generation also ends once the
    text holds one of ``stop_strings`` (the string is kept, like a stop token). For a perplexity task
    ``input_ids`` is the text and ``prefill`` the number of tokens given in one dense forward.
    """

    id: str
    input_ids: list[int]
    answers: list[str] = field(default_factory=list)
    max_new_tokens: int = 0
    stop_at_newline: bool = False
    stop_strings: tuple[str, ...] = ()
    prefill: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


class TaskMetric(Protocol):
    """How a task is scored (``scoring.EvaluateMetric`` for the benchmarks)."""

    def score(self, predictions: Sequence[str], samples: Sequence[Sample]) -> dict[str, list[float]]:
        """Per-sample scores in [0, 1] by metric name; the first name is the task's headline metric."""
        ...


@dataclass
class Task:
    """A named list of samples. ``kind`` is "generate" (score the decoded text) or "perplexity".

    ``metric`` is None for reference-free tasks (only the fidelity to dense is reported); ``bucket`` (optional)
    names the length bucket of a sample (LongBench-E).
    """

    name: str
    samples: list[Sample]
    metric: TaskMetric | None = None
    kind: Literal["generate", "perplexity"] = "generate"
    bucket: Callable[[Sample], str] | None = None

    def __post_init__(self) -> None:
        repeated = sorted(sample_id for sample_id, count in Counter(sample.id for sample in self.samples).items()
                          if count > 1)
        if repeated:  # predictions are stored and summarised by id: a repeated one would count once
            raise ValueError(f"task {self.name!r} has several samples with the id(s) {repeated}; each sample needs "
                             "its own (e.g. two --data files of one name: rename or drop one)")
