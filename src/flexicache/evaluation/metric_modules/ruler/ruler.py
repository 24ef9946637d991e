"""RULER string matching as an ``evaluate`` module that works offline.

    import evaluate
    from flexicache.evaluation.scoring import module_path
    metric = evaluate.load(module_path("ruler"), "string_match_all")   # or "string_match_part"
    metric.compute(predictions=["it is 123"], references=[["123", "456"]])  # {"string_match_all": 50.0, ...}

``string_match_all``: share of the references found in the prediction (case-insensitive); ``string_match_part``:
1 when any is. The headline is the mean x100 (RULER's report).
"""

import datasets
import evaluate

from flexicache.evaluation import metrics

_CITATION = """@inproceedings{hsieh2024ruler,
  title = {RULER: What's the Real Context Size of Your Long-Context Language Models?},
  author = {Hsieh, Cheng-Ping and others}, booktitle = {COLM}, year = {2024}}"""
_FUNCTIONS = {"string_match_all": metrics.string_match_all, "string_match_part": metrics.string_match_part}


class Ruler(evaluate.Metric):
    """RULER's ``string_match_all`` / ``string_match_part``."""

    def _info(self) -> evaluate.MetricInfo:
        if self.config_name not in _FUNCTIONS:
            raise KeyError(f"unknown RULER metric {self.config_name!r}: give one of {sorted(_FUNCTIONS)} as the config")
        return evaluate.MetricInfo(
            description=__doc__, citation=_CITATION, inputs_description="predictions: text; references: the needles",
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Sequence(datasets.Value("string"))}))

    def _compute(self, predictions: list[str], references: list[list[str]]) -> dict:
        function = _FUNCTIONS[self.config_name]
        scores = [function(prediction, answers) for prediction, answers in zip(predictions, references, strict=True)]
        return {self.config_name: 100 * (sum(scores) / len(scores)), "per_sample": {self.config_name: scores}}
