"""LongBench (v1) and LongBench-E scores as an ``evaluate`` module that works offline.

    import evaluate
    from flexicache.evaluation.scoring import module_path
    metric = evaluate.load(module_path("longbench"), "qasper")        # or "qasper_e", "trec" (+ all_classes), ...
    metric.compute(predictions=["yes"], references=[["yes", "no"]])  # {"qa_f1": 100.0, "per_sample": {...}}

The config is the LongBench dataset name. A sample scores the max of the dataset's metric over its references
(first line only for trec, triviaqa, samsum and lsht), in [0, 1]; the headline is their mean x100, as the
benchmark's ``eval.py`` reports it. The classification datasets (trec, lsht) also take ``all_classes``.
"""

import datasets
import evaluate

from flexicache.evaluation import longbench

_CITATION = """@inproceedings{bai2024longbench,
  title = {LongBench: A Bilingual, Multitask Benchmark for Long Context Understanding},
  author = {Bai, Yushi and others}, booktitle = {ACL}, year = {2024}}"""


class LongBench(evaluate.Metric):
    """The official per-dataset LongBench metrics (see ``flexicache.evaluation.longbench.METRICS``)."""

    def _info(self) -> evaluate.MetricInfo:
        name = longbench.base_name(self.config_name)
        if name not in longbench.METRICS:
            raise KeyError(f"unknown LongBench dataset {self.config_name!r}: give one of {sorted(longbench.METRICS)} "
                           "(or a LongBench-E name ending in '_e') as the config name")
        features = {"predictions": datasets.Value("string"), "references": datasets.Sequence(datasets.Value("string"))}
        if longbench.METRICS[name].uses_classes:
            features["all_classes"] = datasets.Sequence(datasets.Value("string"))
        return evaluate.MetricInfo(
            description=__doc__, citation=_CITATION, features=datasets.Features(features),
            inputs_description="predictions: generated text; references: the answers; all_classes (trec, lsht): "
                               "the class names")

    def _compute(self, predictions: list[str], references: list[list[str]],
                 all_classes: list[list[str]] | None = None) -> dict:
        metric = longbench.METRICS[longbench.base_name(self.config_name)].name
        classes = all_classes if all_classes is not None else [None] * len(predictions)
        scores = [longbench.score(self.config_name, prediction, answers, names)
                  for prediction, answers, names in zip(predictions, references, classes, strict=True)]
        return {metric: 100 * (sum(scores) / len(scores)), "per_sample": {metric: scores}}
