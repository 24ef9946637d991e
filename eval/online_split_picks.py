"""Which heads the online split makes unstable on several files, under each ``split_score``, and how much the picks
agree from file to file (heads common to every file, mean pairwise Jaccard overlap).

Each file's first ``--tokens`` tokens are one prompt forward into a fresh ``FlexiCache.from_model(model,
token_budget=...)`` without a profile (CPU, fp32).

Usage: ``python eval/online_split_picks.py [--model smollm2] [--budget 192] [--tokens 1024] [FILE ...]`` (default
files: ``typing.py argparse.py dataclasses.py inspect.py`` of the standard library).
"""

from __future__ import annotations

import argparse
import itertools
import sysconfig
from pathlib import Path
from typing import get_args

import torch

from flexicache import FlexiCache
from flexicache.config import SplitScoreName
from flexicache.models import load_model

DEFAULT_FILES = ("typing.py", "argparse.py", "dataclasses.py", "inspect.py")


def unstable_heads(model, tokenizer, text: str, tokens: int, budget: int, score: str) -> set[tuple[int, int]]:
    """``(layer, KV head)`` of every head the online split makes unstable for the prompt ``text[:tokens]``."""
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :tokens]
    cache = FlexiCache.from_model(model, token_budget=budget, split_score=score)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    return {(index, head) for index, layer in enumerate(cache.layers) for head in getattr(layer, "unstable_heads", [])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", default=list(DEFAULT_FILES))
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--budget", type=int, default=192)
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = {name: (stdlib / name if not Path(name).exists() else Path(name)).read_text() for name in args.files}
    for score in get_args(SplitScoreName):
        picks = {name: unstable_heads(model, tokenizer, text, args.tokens, args.budget, score)
                 for name, text in texts.items()}
        for name, heads in picks.items():
            print(f"{score:<9} {name:<16} {len(heads)} unstable: {sorted(heads)}")
        common = set.intersection(*picks.values())
        pairs = [len(a & b) / len(a | b) for a, b in itertools.combinations(picks.values(), 2)]
        print(f"{score:<9} common to all {len(picks)} files: {len(common)} {sorted(common)}; "
              f"mean pairwise Jaccard {sum(pairs) / len(pairs):.2f}", flush=True)


if __name__ == "__main__":
    main()
