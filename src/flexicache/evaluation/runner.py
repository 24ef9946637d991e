"""Runs tasks under several methods (caches), stores predictions (resumable) and summarises them against dense.

Layout of a results folder::

    methods.json                        each method's settings, by name (a name keeps its settings)
    predictions/<task>/<method>.jsonl   one record per sample, appended as soon as it is done
    metrics.json                        per task: scores, ratio to dense, fidelity, LongBench-E buckets, stats
    table.md                            the printed table

A batch's dense prefill is run once and shared by the methods whose caches can take it (see
:mod:`~flexicache.evaluation.shared_prefill`): their records hold ``prefill_seconds``, the wall time of that shared
prefill (the same in every such record of the batch), and ``seconds``, the method's own time (filling its cache from
the prefill, the rest of the prompt, the decode). A record without ``prefill_seconds`` comes from a method that ran
its own prefill, and its ``seconds`` include it. Either way ``seconds`` and ``stats`` are the batch's.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from . import metrics
from .generation import as_input, generate, newline_token, stop_tokens
from .methods import REFERENCE, CacheMethod, Method
from .perplexity import check_prefill, decode_nll, perplexity
from .shared_prefill import DensePrefill, can_fill, decode_nll_from, generate_from, prefill_forward, prefill_generation
from .tasks import Sample, Task

__all__ = ["Method", "PredictionStore", "format_table", "run_tasks", "summarize"]


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "tolist"):  # tensors and numpy values
        return value.tolist()
    return value


def cache_stats(cache: Any) -> dict[str, Any]:
    """``cache.stats()`` when the cache has it (FlexiCache), as plain JSON values; else {}."""
    stats = getattr(cache, "stats", None)
    return _jsonable(stats()) if callable(stats) else {}


class PredictionStore:
    """Append-only JSONL prediction files, one per (task, method), and the methods' settings."""

    def __init__(self, root: str | Path):
        self.root = Path(root) / "predictions"
        self.methods_file = Path(root) / "methods.json"

    def check_methods(self, methods: Sequence[CacheMethod]) -> None:
        """Record each method's settings; refuse a method whose name was stored with other settings."""
        stored = json.loads(self.methods_file.read_text(encoding="utf-8")) if self.methods_file.exists() else {}
        for method in methods:
            settings = _jsonable(method.settings)
            if settings is not None and stored.get(method.name, settings) != settings:
                raise ValueError(f"{self.methods_file.parent} holds predictions of a method {method.name!r} with "
                                 f"settings {stored[method.name]}, not {settings}; name this one differently or "
                                 "use another results folder")
            if settings is not None:
                stored[method.name] = settings
        self.methods_file.parent.mkdir(parents=True, exist_ok=True)
        self.methods_file.write_text(json.dumps(stored, indent=2) + "\n", encoding="utf-8")

    def path(self, task: str, method: str) -> Path:
        return self.root / task / f"{method}.jsonl"

    def load(self, task: str, method: str) -> dict[str, dict[str, Any]]:
        """Records by sample id (a truncated last line from an interrupted run is ignored)."""
        path = self.path(task, method)
        records: dict[str, dict[str, Any]] = {}
        if path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                records[record["_id"]] = record
        return records

    def append(self, task: str, method: str, record: Mapping[str, Any]) -> None:
        """Add one record as a line (after ending a line an interrupted run left unfinished, which stays unread)."""
        path = self.path(task, method)
        path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with open(path, "a+b") as handle:
            if handle.seek(0, os.SEEK_END) > 0:
                handle.seek(-1, os.SEEK_END)
                if handle.read(1) != b"\n":
                    line = "\n" + line
            handle.write(line.encode("utf-8"))


def generation_settings(samples: Sequence[Sample], decode_tail: int, stop_ids: set[int], newline: int,
                        tokenizer: Any) -> dict[str, Any]:
    """The keyword arguments of :func:`~flexicache.evaluation.generation.generate` (and of the shared-prefill
    functions) for a batch of generation samples, which share a length and a stopping rule."""
    first = samples[0]
    return {"max_new_tokens": first.max_new_tokens,
            "stop_ids": stop_ids | {newline} if first.stop_at_newline else stop_ids,
            "min_new_tokens": 1 if first.stop_at_newline else 0, "decode_tail": decode_tail,
            "stop_strings": first.stop_strings, "tokenizer": tokenizer}


def dense_prefill(model: Any, tokenizer: Any, task: Task, samples: Sequence[Sample], decode_tail: int,
                  stop_ids: set[int], newline: int) -> DensePrefill | None:
    """The dense prefill :func:`run_batch` would run for ``samples`` under any method, to share (None when this
    model cannot share it)."""
    if task.kind == "perplexity":
        (sample,) = samples
        check_prefill(sample.input_ids, sample.prefill)
        return prefill_forward(model, as_input(model, [sample.input_ids[:sample.prefill]]))
    return prefill_generation(model, [s.input_ids for s in samples],
                              **generation_settings(samples, decode_tail, stop_ids, newline, tokenizer))


def run_batch(model: Any, tokenizer: Any, task: Task, samples: Sequence[Sample], cache: Any, decode_tail: int,
              stop_ids: set[int], newline: int, prefill: DensePrefill | None = None) -> list[dict[str, Any]]:
    """Run samples (one, or several generation samples of one prompt length and stopping rule) in one fresh
    ``cache``, from the shared ``prefill`` of these samples when given; returns their prediction records
    (``seconds``, ``prefill_seconds`` and ``stats``: see the module docstring)."""
    start = time.perf_counter()
    records: list[dict[str, Any]] = [{"_id": s.id, "prompt_tokens": len(s.input_ids)} for s in samples]
    if task.kind == "perplexity":
        (sample,), (record,) = samples, records
        if prefill is None:
            nll, count = decode_nll(model, sample.input_ids, cache, sample.prefill)
        else:
            nll, count = decode_nll_from(model, sample.input_ids, cache, prefill)
        record.update(nll=nll, scored_tokens=count, ppl=perplexity(nll, count))
    else:
        prompts = [s.input_ids for s in samples]
        settings = generation_settings(samples, decode_tail, stop_ids, newline, tokenizer)
        if prefill is None:
            outputs = generate(model, prompts, cache, **settings)
        else:
            outputs = generate_from(model, prompts, cache, prefill, **settings)
        for sample, record, tokens in zip(samples, records, outputs, strict=True):
            record.update(pred=tokenizer.decode(tokens, skip_special_tokens=True), tokens=tokens,
                          answers=sample.answers, **{k: v for k, v in sample.meta.items() if k in ("length",)})
    seconds, stats = round(time.perf_counter() - start, 3), cache_stats(cache)
    shared = {} if prefill is None else {"prefill_seconds": round(prefill.seconds, 3)}
    for record in records:
        record.update(batch_size=len(samples), seconds=seconds, **shared, stats=stats)
    return records


def run_methods(model: Any, tokenizer: Any, task: Task, samples: Sequence[Sample], methods: Sequence[CacheMethod],
                decode_tail: int, stop_ids: set[int], newline: int, share_prefill: bool = True
                ) -> Iterator[tuple[CacheMethod, list[dict[str, Any]]]]:
    """Run ``samples`` under each of ``methods`` in turn; yields each method with its records as soon as it is done.

    With ``share_prefill``, the dense prefill runs once, at the first method whose cache can be filled from it, and
    serves every such method; the others (and all of them without ``share_prefill``) run their own.
    """
    prefill: DensePrefill | None = None
    tried = False
    for method in methods:
        cache = method.make_cache()
        fillable = share_prefill and can_fill(cache)
        if fillable and not tried:
            prefill, tried = dense_prefill(model, tokenizer, task, samples, decode_tail, stop_ids, newline), True
        records = run_batch(model, tokenizer, task, samples, cache, decode_tail, stop_ids, newline,
                            prefill if fillable else None)
        del cache  # its memory comes back before the next method's cache is made
        yield method, records


def batches(task: Task, samples: Sequence[Sample], batch_size: int) -> Iterator[list[Sample]]:
    """``samples`` in batches of at most ``batch_size`` that share a prompt length and a stopping rule: each batch
    as soon as it is full, the partial ones at the end (generation tasks only; a perplexity sample runs alone)."""
    if task.kind == "perplexity" or batch_size <= 1:
        yield from ([sample] for sample in samples)
        return
    groups: dict[tuple, list[Sample]] = {}
    for sample in samples:
        key = (len(sample.input_ids), sample.max_new_tokens, sample.stop_at_newline, sample.stop_strings)
        group = groups.setdefault(key, [])
        group.append(sample)
        if len(group) == batch_size:
            yield groups.pop(key)
    yield from groups.values()


def run_tasks(model: Any, tokenizer: Any, tasks: Sequence[Task], methods: Sequence[CacheMethod],
              out_dir: str | Path, decode_tail: int = 0, progress: bool = True, batch_size: int = 1,
              share_prefill: bool = True, predict: bool = True) -> dict[str, Any]:
    """Predict every (task, sample, method) not already stored (``predict=False``: none, a partly finished
    folder's summary of what it holds), then summarise; writes metrics.json and table.md and returns the summary.
    ``batch_size`` > 1 generates equal-length prompts of a task together (faster on a GPU; a row's tokens may then
    differ from a batch of one by floating-point rounding).
    ``share_prefill``: one dense prefill per batch for the methods that still need that batch (see
    :func:`run_methods`); the predictions are the same either way."""
    from tqdm.auto import tqdm

    store = PredictionStore(out_dir)
    store.check_methods(methods)
    stop_ids, newline = stop_tokens(model, tokenizer), newline_token(tokenizer)
    for task in tasks if predict else ():
        done = {m.name: set(store.load(task.name, m.name)) for m in methods}
        with tqdm(total=len(task.samples), desc=task.name, disable=not progress, unit="sample") as bar:
            for batch in batches(task, task.samples, batch_size):
                for todo, group in pending_groups(batch, methods, done):
                    for method, records in run_methods(model, tokenizer, task, todo, group, decode_tail, stop_ids,
                                                       newline, share_prefill):
                        for record in records:
                            store.append(task.name, method.name, record)
                bar.update(len(batch))
    names = [m.name for m in methods]
    summary = summarize(tasks, {t.name: {m: store.load(t.name, m) for m in names} for t in tasks}, names)
    out = Path(out_dir)
    (out / "metrics.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "table.md").write_text(format_table(summary) + "\n", encoding="utf-8")
    return summary


def pending_groups(batch: Sequence[Sample], methods: Sequence[CacheMethod], done: Mapping[str, set[str]]
                   ) -> list[tuple[list[Sample], list[CacheMethod]]]:
    """The methods that still lack some samples of ``batch`` (``done``: stored sample ids by method name), grouped
    by the samples they lack, in the methods' order: each group runs those samples as one batch."""
    groups: dict[tuple[str, ...], tuple[list[Sample], list[CacheMethod]]] = {}
    for method in methods:
        todo = [sample for sample in batch if sample.id not in done[method.name]]
        if todo:
            groups.setdefault(tuple(s.id for s in todo), (todo, []))[1].append(method)
    return list(groups.values())


# ---------------------------------------------------------------- summaries
def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def _ratio(value: float | None, reference: float | None) -> float | None:
    return None if value is None or not reference else value / reference


def _sample_scores(task: Task, samples: Mapping[str, Sample], records: Mapping[str, dict]) -> dict[str, dict]:
    """{sample id: {metric name: score in [0, 1]}} ({} for a task without a metric)."""
    if task.metric is None or not records:
        return {}
    ids = list(records)
    by_name = task.metric.score([records[i]["pred"] for i in ids], [samples[i] for i in ids])
    return {i: {name: values[k] for name, values in by_name.items()} for k, i in enumerate(ids)}


def _stats_means(records: Iterable[dict]) -> dict[str, float]:
    columns: dict[str, list[float]] = {}
    for record in records:
        for key, value in record.get("stats", {}).items():
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                columns.setdefault(key, []).append(float(value))
    return {key: sum(v) / len(v) for key, v in columns.items()}


def _fidelity(records: Mapping[str, dict], reference: Mapping[str, dict]) -> dict[str, Any]:
    common = [i for i in records if i in reference]
    if not common:
        return {}
    divergences = [metrics.first_divergence(records[i]["tokens"], reference[i]["tokens"]) for i in common]
    diverged = [d for d in divergences if d is not None]
    return {
        "n": len(common),
        "rouge_l_vs_dense": _mean(metrics.rouge_l_f1(records[i]["pred"].split(), reference[i]["pred"].split())
                                  for i in common),
        "identical": sum(d is None for d in divergences) / len(common),
        "first_divergence_mean": _mean(diverged),
        "first_divergence_min": min(diverged) if diverged else None,
    }


def summarize_task(task: Task, records: Mapping[str, Mapping[str, dict]], reference: str = REFERENCE
                   ) -> dict[str, Any]:
    """Summary of one task from its stored records by method (only samples of ``task`` count)."""
    samples = {s.id: s for s in task.samples}
    kept = {m: {i: r for i, r in recs.items() if i in samples} for m, recs in records.items()}
    ref = kept.get(reference, {})
    out: dict[str, Any] = {"kind": task.kind, "n": {m: len(recs) for m, recs in kept.items()},
                           "score": {}, "ratio": {}}
    if task.kind == "perplexity":
        out["metric"] = "ppl"
        for method, recs in kept.items():
            out["score"][method] = (perplexity(sum(r["nll"] for r in recs.values()),
                                               sum(r["scored_tokens"] for r in recs.values())) if recs else None)
            common = [i for i in recs if i in ref]
            if method != reference and common:
                out["ratio"][method] = (perplexity(sum(recs[i]["nll"] for i in common),
                                                   sum(recs[i]["scored_tokens"] for i in common))
                                        / perplexity(sum(ref[i]["nll"] for i in common),
                                                     sum(ref[i]["scored_tokens"] for i in common)))
    else:
        scores = {m: _sample_scores(task, samples, recs) for m, recs in kept.items()}
        names = next((list(s) for per in scores.values() for s in per.values() if s), [])
        out["metric"] = names[0] if names else None
        out["common_scores"] = {}  # method: [its mean, dense's] headline score over the samples both have
        out["scores"] = {m: {name: _pct(_mean(s[name] for s in per.values())) for name in names}
                         for m, per in scores.items()}
        for method, per in scores.items():
            out["score"][method] = out["scores"][method].get(out["metric"]) if names else None
            common = [i for i in per if i in scores.get(reference, {})]
            if method != reference and names and common:
                out["common_scores"][method] = [_mean(per[i][names[0]] for i in common),
                                                _mean(scores[reference][i][names[0]] for i in common)]
                out["ratio"][method] = _ratio(*out["common_scores"][method])
        if task.bucket and names:
            out["buckets"] = {m: _bucket_scores(task, samples, per, names[0]) for m, per in scores.items()}
        out["fidelity"] = {m: _fidelity(recs, ref) for m, recs in kept.items() if m != reference}
    out["stats"] = {m: _stats_means(recs.values()) for m, recs in kept.items()}
    return out


def _pct(value: float | None) -> float | None:
    return None if value is None else 100 * value


def _bucket_scores(task: Task, samples: Mapping[str, Sample], per: Mapping[str, dict], name: str
                   ) -> dict[str, float | None]:
    groups: dict[str, list[float]] = {}
    for i, scores in per.items():
        groups.setdefault(task.bucket(samples[i]), []).append(scores[name])
    return {bucket: _pct(_mean(values)) for bucket, values in sorted(groups.items())}


def summarize(tasks: Sequence[Task], records: Mapping[str, Mapping[str, Mapping[str, dict]]],
              methods: Sequence[str], reference: str = REFERENCE) -> dict[str, Any]:
    """Per-task summaries plus the average of the headline scores over the scored generation tasks (a method's
    ratio: its average over dense's, each task's score taken over the samples both have)."""
    per_task = {t.name: summarize_task(t, records[t.name], reference) for t in tasks}
    scored = [s for s in per_task.values() if s["kind"] == "generate" and s["metric"]]
    average: dict[str, Any] = {"score": {}, "ratio": {}}
    if scored:
        for method in methods:
            values = [s["score"].get(method) for s in scored]
            average["score"][method] = _mean(values) if all(v is not None for v in values) else None
        for method in methods:
            pairs = [s["common_scores"].get(method) for s in scored]
            if method != reference and all(pair is not None for pair in pairs):
                average["ratio"][method] = _ratio(_mean(pair[0] for pair in pairs), _mean(pair[1] for pair in pairs))
    return {"reference": reference, "methods": list(methods), "tasks": per_task, "average": average}


# ---------------------------------------------------------------- table
def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def format_table(summary: Mapping[str, Any]) -> str:
    """Markdown table: task | metric | n | dense | each method, its ratio to dense and its ROUGE-L vs dense."""
    reference, methods = summary["reference"], summary["methods"]
    others = [m for m in methods if m != reference]
    header = ["task", "metric", "n"] + ([reference] if reference in methods else [])
    for method in others:
        header += [method, "ratio", "fidelity"]
    rows = [header, ["---"] * len(header)]
    for name, task in list(summary["tasks"].items()) + [("average", summary["average"])]:
        if name == "average" and not task["score"]:
            continue
        row = [name, task.get("metric") or "-", str(max(task.get("n", {}).values(), default=0) or "")]
        if reference in methods:
            row.append(_fmt(task["score"].get(reference)))
        for method in others:
            fidelity = task.get("fidelity", {}).get(method, {})
            row += [_fmt(task["score"].get(method)), _fmt(task["ratio"].get(method), 4),
                    _fmt(fidelity.get("rouge_l_vs_dense"), 4)]
        rows.append(row)
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)
