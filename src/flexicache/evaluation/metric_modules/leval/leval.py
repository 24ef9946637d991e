"""L-Eval's automatic metrics for open-ended generation as an ``evaluate`` module that works offline.

    import evaluate
    from flexicache.evaluation.scoring import module_path
    metric = evaluate.load(module_path("leval"))
    metric.compute(predictions=["a summary"], references=[["the summary"]])  # {"rouge_l": ..., "f1": ..., ...}

Per sample, the max over the references of ROUGE-L F1 (lowercase alphanumeric tokens) and of SQuAD token F1,
in [0, 1]; the headlines are their means x100.
"""

import datasets
import evaluate

from flexicache.evaluation import metrics

_CITATION = """@inproceedings{an2024leval,
  title = {L-Eval: Instituting Standardized Evaluation for Long Context Language Models},
  author = {An, Chenxin and others}, booktitle = {ACL}, year = {2024}}"""


def _rouge_l(prediction: str, answers: list[str]) -> float:
    words = metrics.rouge_words(prediction)
    return max(metrics.rouge_l_f1(words, metrics.rouge_words(answer)) for answer in answers)


class LEval(evaluate.Metric):
    """ROUGE-L and token F1 against L-Eval's reference outputs."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=__doc__, citation=_CITATION, inputs_description="predictions: text; references: outputs",
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Sequence(datasets.Value("string"))}))

    def _compute(self, predictions: list[str], references: list[list[str]]) -> dict:
        pairs = list(zip(predictions, references, strict=True))
        per_sample = {"rouge_l": [_rouge_l(p, answers) for p, answers in pairs],
                      "f1": [max(metrics.qa_f1(p, a) for a in answers) for p, answers in pairs]}
        return {**{name: 100 * (sum(s) / len(s)) for name, s in per_sample.items()}, "per_sample": per_sample}
