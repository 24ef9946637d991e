"""LongBench (v1) and LongBench-E: prompts, generation lengths, loading, truncation and official scoring.

Records follow the benchmark's schema: ``input, context, answers, length, dataset, language, all_classes,
_id``. They are loaded as ``datasets.Dataset`` from a folder with the benchmark's ``data/*.jsonl`` layout, from
JSONL files, from the benchmark's ``data.zip`` archive, or (online only) from the hub's ``data.zip``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import metrics
from .data import jsonl_files, load_jsonl, rows
from .prompting import middle_truncate, render
from .scoring import EvaluateMetric
from .tasks import Sample, Task

_QA_PASSAGES = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\n"
    "The following are given passages.\n{context}\n\n"
    "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\n"
    "Question: {input}\nAnswer:"
)
_QASPER_RULES = (
    "as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered "
    'based on the information in the article, write "unanswerable". If the question is a yes/no question, answer '
    '"yes", "no", or "unanswerable". Do not provide any explanation.'
)

PROMPTS: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the question "
        "as concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\n"
        "Story: {context}\n\nNow, answer the question based on the story as concisely as you can, using a single "
        "phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. Answer the question " + _QASPER_RULES
        + "\n\nArticle: {context}\n\n Answer the question based on the above article " + _QASPER_RULES
        + "\n\nQuestion: {input}\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on "
        "the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "multifieldqa_zh": (
        "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。"
        "\n\n问题：{input}\n回答："
    ),
    "hotpotqa": _QA_PASSAGES,
    "2wikimqa": _QA_PASSAGES,
    "musique": _QA_PASSAGES,
    "dureader": (
        "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答："
    ),
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
        "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the query in "
        "one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting "
        "transcript in one or more sentences.\n\nQuery: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\n"
        "Now, write a one-page summary of all the news.\n\nSummary:"
    ),
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": (
        "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any other words. "
        "The following are some examples.\n\n{context}\n\n{input}"
    ),
    "samsum": (
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully "
        "read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In "
        "other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final "
        "count of unique paragraphs after removing duplicates. The output format should only contain the number, "
        "such as 1, 2, 3, and so on.\n\nThe final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the "
        "abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of "
        'the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", '
        "etc.\n\nThe answer is: "
    ),
    "passage_retrieval_zh": (
        "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n\n"
        '请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：'
    ),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

MAX_NEW_TOKENS: dict[str, int] = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64, "hotpotqa": 32,
    "2wikimqa": 32, "musique": 32, "dureader": 128, "gov_report": 512, "qmsum": 512, "multi_news": 512,
    "vcsum": 512, "trec": 64, "triviaqa": 32, "samsum": 128, "lsht": 64, "passage_count": 32,
    "passage_retrieval_en": 32, "passage_retrieval_zh": 32, "lcc": 64, "repobench-p": 64,
}


@dataclass(frozen=True)
class Metric:
    """A LongBench metric: its report name, the per-reference function and whether that takes the class names."""

    name: str
    fn: Callable[[str, str, Sequence[str]], float]
    uses_classes: bool = False


def _plain(fn: Callable[[str, str], float]) -> Callable[[str, str, Sequence[str]], float]:
    return lambda prediction, reference, _classes: fn(prediction, reference)


_QA_F1 = Metric("qa_f1", _plain(metrics.qa_f1))
_ROUGE = Metric("rouge_l", _plain(metrics.longbench_rouge_l))
_CODE = Metric("code_sim", _plain(metrics.code_sim))
METRICS: dict[str, Metric] = {
    "narrativeqa": _QA_F1, "qasper": _QA_F1, "multifieldqa_en": _QA_F1,
    "multifieldqa_zh": Metric("qa_f1_zh", _plain(metrics.qa_f1_zh)),
    "hotpotqa": _QA_F1, "2wikimqa": _QA_F1, "musique": _QA_F1,
    "dureader": Metric("rouge_l_zh", _plain(metrics.longbench_rouge_l_zh)),
    "gov_report": _ROUGE, "qmsum": _ROUGE, "multi_news": _ROUGE,
    "vcsum": Metric("rouge_l_zh", _plain(metrics.longbench_rouge_l_zh)),
    "trec": Metric("classification", metrics.classification, uses_classes=True), "triviaqa": _QA_F1, "samsum": _ROUGE,
    "lsht": Metric("classification", metrics.classification, uses_classes=True),
    "passage_count": Metric("count", _plain(metrics.count)),
    "passage_retrieval_en": Metric("retrieval", _plain(metrics.retrieval)),
    "passage_retrieval_zh": Metric("retrieval_zh", _plain(metrics.retrieval_zh)),
    "lcc": _CODE, "repobench-p": _CODE,
}

LONGBENCH_TASKS: tuple[str, ...] = tuple(PROMPTS)
LONGBENCH_E_TASKS: tuple[str, ...] = (
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec", "triviaqa",
    "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)
NO_CHAT_TASKS = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
"""Few-shot and code tasks: the raw prompt, no chat template (as the benchmark's pred.py)."""
FIRST_LINE_TASKS = frozenset({"trec", "triviaqa", "samsum", "lsht"})
"""Tasks scored on the first line of the prediction only."""
DEFAULT_HUB_REPO = "THUDM/LongBench"


def base_name(dataset: str) -> str:
    """'qasper_e' -> 'qasper' (LongBench-E files carry the suffix)."""
    return dataset[:-2] if dataset.endswith("_e") and dataset[:-2] in PROMPTS else dataset


def length_bucket(length: int) -> str:
    """LongBench-E bucket of a record's ``length`` field."""
    return "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"


def score(dataset: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None) -> float:
    """The benchmark's per-sample score in [0, 1]: the first-line rule where it applies, then the max of the
    task metric over the references (0 when there is none)."""
    name = base_name(dataset)
    if name in FIRST_LINE_TASKS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = METRICS[name]
    return max([0.0] + [metric.fn(prediction, answer, all_classes or ()) for answer in answers])


# ---------------------------------------------------------------- loading
def _dataset_of(stem: str, records: Any) -> str:
    if base_name(stem) in PROMPTS:
        return stem
    names = set(records["dataset"]) if "dataset" in records.column_names else set()
    if len(names) == 1 and base_name(str(next(iter(names)))) in PROMPTS:
        return str(names.pop())
    raise ValueError(f"{stem}.jsonl: cannot tell the LongBench dataset (file name {stem!r}, records say {names}); "
                     "name the file after the dataset or give its records a 'dataset' field")


def load_local(sources: Iterable[str | Path]) -> dict[str, Any]:
    """A ``datasets.Dataset`` per dataset name from folders (their ``data/*.jsonl`` or ``*.jsonl``), zip
    archives (the benchmark's ``data.zip``) and JSONL files.

    A file's dataset is its stem when that is a LongBench name (``qasper``, ``qasper_e``), else the records'
    common ``dataset`` field; several files of one dataset are concatenated in order.
    """
    import datasets

    parts: dict[str, list[Any]] = {}
    for file in jsonl_files(sources):
        records = load_jsonl(file.data_file)
        parts.setdefault(_dataset_of(file.stem, records), []).append(records)
    return {name: found[0] if len(found) == 1 else datasets.concatenate_datasets(found)
            for name, found in parts.items()}


def download(dest: str | Path, repo_id: str = DEFAULT_HUB_REPO) -> Path:
    """Fetch the benchmark's ``data.zip`` from the hub into ``dest`` (needs network; a second call finds it in
    the cache there) and return its path, for :func:`load_local`. Script-based ``load_dataset`` of the hub
    dataset no longer works (datasets >= 4)."""
    from huggingface_hub import hf_hub_download

    archive = hf_hub_download(repo_id=repo_id, filename="data.zip", repo_type="dataset", cache_dir=Path(dest) / "hub")
    return Path(archive)


# ---------------------------------------------------------------- tasks
def build_prompt(dataset: str, record: Mapping[str, Any]) -> str:
    """The task's instruction template filled with the record."""
    return PROMPTS[base_name(dataset)].format(context=record["context"], input=record["input"])


def build_tasks(
    datasets: Mapping[str, Any],
    tokenizer: Any,
    max_length: int,
    names: Sequence[str] | None = None,
    chat: bool = True,
    limit: int | None = None,
    max_new_tokens: int | None = None,
) -> list[Task]:
    """One task per dataset (a ``datasets.Dataset`` of LongBench records): prompts middle-truncated to
    ``max_length`` tokens, then (``chat`` and not a few-shot/code task) wrapped in the chat template.
    ``max_new_tokens`` caps the benchmark's lengths."""
    tasks = []
    for dataset in names or sorted(datasets):
        if dataset not in datasets:
            raise KeyError(f"no data for {dataset!r}; have {sorted(datasets)}")
        name = base_name(dataset)
        samples = []
        for index, record in enumerate(rows(datasets[dataset], limit)):
            prompt = middle_truncate(tokenizer, build_prompt(dataset, record), max_length)
            samples.append(Sample(
                id=str(record.get("_id") or index),
                input_ids=render(tokenizer, prompt, chat=chat and name not in NO_CHAT_TASKS),
                answers=list(record["answers"]),
                max_new_tokens=min(MAX_NEW_TOKENS[name], max_new_tokens or MAX_NEW_TOKENS[name]),
                stop_at_newline=name == "samsum",
                meta={"length": record.get("length"), "all_classes": record.get("all_classes"),
                      "language": record.get("language")},
            ))

        metric = EvaluateMetric("longbench", dataset, ("all_classes",) if METRICS[name].uses_classes else ())
        bucket = (lambda s: length_bucket(int(s.meta["length"]))) if dataset.endswith("_e") else None
        tasks.append(Task(name=dataset, samples=samples, metric=metric, bucket=bucket))
    return tasks
