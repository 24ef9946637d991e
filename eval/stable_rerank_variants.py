"""Experiment (not FlexiCache options): two ways a stable head could choose its working set at a rerank so that it
goes less stale over the 16 steps until the next one, against FlexiCache's defaults with a quarter of K on standby
(``standby_pages="quarter"``), as decode-mode perplexity.

- ``successor``: a page scores at least its predecessor's box score less ``margin`` logits (``margin * sqrt(D)`` in
  score units), so the pages that follow the best ones come in with them: a head copying an earlier span moves one
  token a step through it (its next page is the one it will want).
- ``recent queries``: a page's score is the highest of its box scores for the current query and the previous 4 decode
  steps' queries, so the working set also covers what the last few queries wanted.

Both change only the scores the rerank ranks (:meth:`flexicache.decode_paths.TorchDecode.stable_scores`, the CPU
path); everything else is those settings (no profile: the head split from the prompt). Each file: its first
``context`` tokens, ``prefill`` of them in one forward, the rest scored one token per forward
(:func:`flexicache.evaluation.perplexity.decode_nll`), budget 1/8 of the context.

Usage: ``python eval/stable_rerank_variants.py [--model smollm2|qwen2.5-coder] [FILE ...]`` (standard-library file
names; default typing.py argparse.py)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import DynamicCache

from flexicache import FlexiCache, decode_paths, layer
from flexicache.evaluation.perplexity import decode_nll, perplexity, stdlib_file
from flexicache.models import load_model

# model -> (context, prefill, budget): the `ppl-1.5k` and `qwen2.5-coder: ppl-2k` rows of eval/RESULTS.md at 1/8
SETTINGS = {"smollm2": (1536, 1024, 192), "qwen2.5-coder": (2048, 1536, 256)}
RECENT_QUERIES = 4


def successor_scores(margin: float) -> Callable[..., torch.Tensor]:
    """A ``stable_scores`` that lifts every page to its predecessor's score less ``margin`` logits."""
    original = decode_paths.TorchDecode.stable_scores

    def stable_scores(self: Any, query: torch.Tensor, num_tokens: torch.Tensor, width: int) -> torch.Tensor:
        scores = original(self, query, num_tokens, width)  # [rows, width]
        lifted = scores.clone()
        lifted[:, 1:] = torch.maximum(scores[:, 1:], scores[:, :-1] - margin * math.sqrt(query.shape[-1]))
        return lifted

    return stable_scores


def recent_query_scores() -> Callable[..., torch.Tensor]:
    """A ``stable_scores`` giving each page its best box score over the current query and the recent decode queries
    the storage keeps (none before the first decode step)."""
    original = decode_paths.TorchDecode.stable_scores

    def stable_scores(self: Any, query: torch.Tensor, num_tokens: torch.Tensor, width: int) -> torch.Tensor:
        storage = self.storage
        scores = original(self, query, num_tokens, width)  # [rows, width]
        for past in storage.__dict__.get("recent_queries", ()):
            grouped = storage.bound_rows(storage.group_queries(past, storage.stable_index), storage.stable_index)
            scores = torch.maximum(scores, original(self, grouped, num_tokens, width))
        return scores

    return stable_scores


def remembering_decode(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A ``FlexiLayer.decode`` that keeps the last :data:`RECENT_QUERIES` queries ``[B, Hq, D]`` on its storage."""

    def decode(self: Any, chunk: Any, query: torch.Tensor, scale: float) -> torch.Tensor:
        output = original(self, chunk, query, scale)
        recent = self.storage.__dict__.setdefault("recent_queries", collections.deque(maxlen=RECENT_QUERIES))
        recent.append(query[:, :, 0].detach().clone())
        return output

    return decode


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    """FlexiCache's CPU decode path patched for the variant ``name`` while the block runs."""
    patches: list[tuple[Any, str, Any]] = []
    if name.startswith("successor"):
        patches.append((decode_paths.TorchDecode, "stable_scores", successor_scores(float(name.split("=")[1]))))
    elif name == "recent queries":
        patches.append((decode_paths.TorchDecode, "stable_scores", recent_query_scores()))
        patches.append((layer.FlexiLayer, "decode", remembering_decode(layer.FlexiLayer.decode)))
    saved = [(owner, attribute, owner.__dict__[attribute]) for owner, attribute, _ in patches]
    for owner, attribute, replacement in patches:
        setattr(owner, attribute, replacement)
    try:
        yield
    finally:
        for owner, attribute, original in saved:
            setattr(owner, attribute, original)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", choices=sorted(SETTINGS))
    parser.add_argument("files", nargs="*", default=["typing.py", "argparse.py"])
    args = parser.parse_args()
    context, prefill, budget = SETTINGS[args.model]
    print(f"{args.model}: {context} tokens, {prefill} prefilled, budget {budget}, no profile", flush=True)
    model, tokenizer = load_model(args.model, device="cpu", dtype=torch.float32)
    methods = ["dense", "defaults", "successor, margin=0", "successor, margin=2", "recent queries"]
    totals = {method: [0.0, 0] for method in methods}
    for name in args.files:
        ids = tokenizer(stdlib_file(name).read_text(), add_special_tokens=True).input_ids[:context]
        for method in methods:
            cache = (DynamicCache(config=model.config) if method == "dense"
                     else FlexiCache(model.config, token_budget=budget, standby_pages="quarter"))
            with variant(method):
                nll, tokens = decode_nll(model, ids, cache, prefill)
            totals[method][0] += nll
            totals[method][1] += tokens
            print(f"{name} {method}: perplexity {perplexity(nll, tokens):.3f}", flush=True)
    print(summary_table(totals))


def summary_table(totals: dict[str, list[float]]) -> str:
    """A markdown table of every method's perplexity over all files (``totals``: method -> [summed NLL, tokens],
    ``"dense"`` among them) and its ratio to dense's."""
    dense = perplexity(*totals["dense"])
    lines = ["| method, all files | perplexity | x dense |", "|---|---|---|"]
    lines += [f"| {method} | {perplexity(nll, tokens):.3f} | {perplexity(nll, tokens) / dense:.3f} |"
              for method, (nll, tokens) in totals.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
