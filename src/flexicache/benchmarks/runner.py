"""The runner of ``flexicache bench``: the cases in order under a time budget, then the outputs.

``bench.json`` and ``report.md`` are written into the output folder after every case (a run cut short keeps what it
did), the PNG plots at the end (``flexicache bench --report-from bench.json`` re-renders all three).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch

from flexicache.benchmarks import decode, memory, rerank, throughput
from flexicache.benchmarks.measure import random_ids, timed_generate
from flexicache.benchmarks.plots import write_plots
from flexicache.benchmarks.report import render_report
from flexicache.benchmarks.suite import CASES, CaseResult, Settings, Suite, release, systems

RUNNERS = {"memory": memory.run, "decode": decode.run, "attention": rerank.run_attention, "rerank": rerank.run,
           "throughput": throughput.run, "mix": throughput.run_mix}


def run_suite(settings: Settings, out: Path, command: str = "") -> dict[str, Any]:
    """Run the selected cases for every model; returns the results written to ``out/bench.json``."""
    torch.manual_seed(settings.seed)
    suite = Suite(settings, out, command)
    print(f"flexicache bench: {settings.device}, models {settings.models}, {settings.layers} layers, "
          f"cases {settings.cases}", flush=True)
    suite.results["warmup_s"] = round(warmup(suite), 1)
    cases = [case for case in CASES if case in settings.cases]
    for index, case in enumerate(cases):
        suite.set_case_deadline(cases[index:])
        result = CaseResult()
        for model_name in settings.models:
            RUNNERS[case](suite, model_name, result)
        suite.results["cases"][case] = dataclasses.asdict(result)
        write_outputs(suite, plots=False)
    write_outputs(suite, plots=True)
    return suite.results


def write_outputs(suite: Suite, plots: bool) -> None:
    """``bench.json`` and ``report.md`` of the run so far, and (``plots``) the PNG plots, into ``suite.out``."""
    suite.results["elapsed_s"] = round(suite.elapsed(), 1)
    suite.out.mkdir(parents=True, exist_ok=True)
    if plots:
        suite.results["plots"] = write_plots(suite.results, suite.out)
    (suite.out / "bench.json").write_text(json.dumps(suite.results, indent=1) + "\n", encoding="utf-8")
    (suite.out / "report.md").write_text(render_report(suite.results), encoding="utf-8")


def warmup(suite: Suite) -> float:
    """A short prefill + decode per attention path (FlashInfer/Triton JIT compile, cuBLAS, sdpa), untimed; seconds."""
    start = time.perf_counter()
    settings = suite.settings
    prompt = 8 * settings.page_size
    for model_name in settings.models:
        model = suite.model(model_name)
        ids = random_ids(1, prompt, model.config.vocab_size, suite.device, settings.seed)
        for system in systems(["dynamic", f"flexicache-{2 * settings.page_size}", "dense"]):
            model.set_attn_implementation(system.attn_implementation)
            timed_generate(model, system.make_cache(model.config, prompt + 8, settings), ids, 4)
            release(suite.device)
    return time.perf_counter() - start
