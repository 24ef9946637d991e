"""Experiment (not a FlexiCache option): a fixed total budget split across layers by the diagnostic's recall,
against the same budget in every layer, as decode-mode perplexity of SmolLM2 on files the split was not made from.

The split: from ``eval/results/cpu/diagnose/typing-2k/diagnosis.json`` (``flexicache diagnose`` on ``typing.py``, 2k
tokens, budgets 128 / 256 / 512), each layer takes 128, 256 or 512 tokens so that the summed mean recall of its
selection is largest with 256 per layer on average; scaled by 3/4 for 1.5k-token texts (1/8 of the context either
way). Each file: its first 1536 tokens, 1024 prefilled, the rest scored one token per forward; rows: dense
(DynamicCache), FlexiCache's defaults but a quarter of K on standby (``standby_pages="quarter"``) at budget 192
(no profile), and the same with each layer's budget set from the
split (the layers' own ``settings`` replaced before the prefill; a layer's budget also enters its head split from
the prompt, :mod:`flexicache.head_split`).

Usage: ``python eval/layer_budget_split.py [FILE ...]`` (standard-library file names; default dataclasses.py
inspect.py)
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch
from transformers import DynamicCache

from flexicache import FlexiCache
from flexicache.evaluation.perplexity import decode_nll, perplexity, stdlib_file
from flexicache.models import load_model

DIAGNOSIS = Path(__file__).parent / "results/cpu/diagnose/typing-2k/diagnosis.json"
BUDGETS = (128, 256, 512)  # the diagnosis' budgets (2k tokens)
CONTEXT, PREFILL, BUDGET = 1536, 1024, 192


def recall_maximising_split(diagnosis: dict) -> list[int]:
    """Per-layer budgets from ``BUDGETS`` with the mean of ``BUDGETS[1]``, maximising the summed layer recall."""
    recall = {b: [sum(heads) / len(heads) for heads in diagnosis["budgets"][str(b)]["flexicache"]["recall_by_head"]]
              for b in BUDGETS}
    layers, unit = len(recall[BUDGETS[1]]), BUDGETS[0]
    best: dict[int, tuple[float, list[int]]] = {0: (0.0, [])}  # units spent -> (summed recall, budgets so far)
    for layer in range(layers):
        grown: dict[int, tuple[float, list[int]]] = {}
        for spent, (total, picks) in best.items():
            for budget in BUDGETS:
                units = spent + budget // unit
                value = total + recall[budget][layer]
                if units <= layers * BUDGETS[1] // unit and (units not in grown or grown[units][0] < value):
                    grown[units] = (value, picks + [budget])
        best = grown
    target = layers * BUDGETS[1] // unit
    if target not in best:
        raise ValueError(f"no split of {BUDGETS} sums to {BUDGETS[1]} per layer over {layers} layers")
    return best[target][1]


def main() -> None:
    files = sys.argv[1:] or ["dataclasses.py", "inspect.py"]
    split = [budget * BUDGET // BUDGETS[1] for budget in recall_maximising_split(json.loads(DIAGNOSIS.read_text()))]
    print(f"per-layer budgets (mean {sum(split) / len(split):.0f}): {split}", flush=True)
    model, tokenizer = load_model("smollm2", device="cpu", dtype=torch.float32)
    totals: dict[str, list[float]] = {}
    for name in files:
        ids = tokenizer(stdlib_file(name).read_text(), add_special_tokens=True).input_ids[:CONTEXT]
        for method in ("dense", "uniform", "split"):
            if method == "dense":
                cache = DynamicCache(config=model.config)
            else:
                cache = FlexiCache(model.config, token_budget=BUDGET, standby_pages="quarter")
                if method == "split":
                    for layer, budget in zip(cache.layers, split, strict=True):
                        layer.settings = dataclasses.replace(cache.settings, token_budget=budget)
            nll, tokens = decode_nll(model, ids, cache, PREFILL)
            totals.setdefault(method, [0.0, 0])
            totals[method][0] += nll
            totals[method][1] += tokens
            print(f"{name} {method}: perplexity {perplexity(nll, tokens):.3f}", flush=True)
    dense = perplexity(*totals["dense"])
    for method, (nll, tokens) in totals.items():
        print(f"all files {method}: perplexity {perplexity(nll, tokens):.3f} ({perplexity(nll, tokens) / dense:.3f} "
              "of dense)")


if __name__ == "__main__":
    main()
