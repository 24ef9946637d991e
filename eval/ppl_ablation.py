"""Decode-mode perplexity of SmolLM2 on argparse.py (1k tokens, 128 prefilled): which FlexiCache setting costs what.

Usage: ``python eval/ppl_ablation.py``. Prints one line per configuration: perplexity and its ratio to dense.
Configurations: the default profile, the shipped profile, every head unstable (Quest-like: all pages on the
device, rerank every step), Quest-like with 8-token pages, Quest-like with sum over the GQA group, and larger
budgets with the shipped profile.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from flexicache import FlexiCache, HeadProfile
from flexicache.evaluation.perplexity import decode_nll, perplexity, stdlib_file
from flexicache.models import load_model
from flexicache.profiles import shipped_profile_path

CONTEXT, PREFILL = 1024, 128


def main() -> None:
    torch.set_num_threads(1)
    model, tokenizer = load_model()
    ids = tokenizer(stdlib_file("argparse.py").read_text())["input_ids"][:CONTEXT]
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    every_head = HeadProfile(layers, heads, model.config.head_dim, [(l, h) for l in range(layers) for h in range(heads)])
    shipped = HeadProfile.load(shipped_profile_path("smollm2-135m-instruct"))
    dense = perplexity(*decode_nll(model, ids, DynamicCache(config=model.config), PREFILL))
    print(f"dense: ppl {dense:.3f}")
    configurations = [
        ("default profile, budget 128", dict(token_budget=128, profile="default")),
        ("no profile (estimated from the prompt), budget 128", dict(token_budget=128)),
        ("shipped profile, budget 128", dict(token_budget=128, profile=shipped)),
        ("Quest-like (all unstable), budget 128", dict(token_budget=128, profile=every_head)),
        ("Quest-like, budget 128, page size 8", dict(token_budget=128, profile=every_head, page_size=8)),
        ("Quest-like, budget 128, group sum", dict(token_budget=128, profile=every_head, group_reduce="sum")),
        ("shipped profile, budget 256", dict(token_budget=256, profile=shipped)),
        ("shipped profile, budget 512", dict(token_budget=512, profile=shipped)),
    ]
    for name, settings in configurations:
        value = perplexity(*decode_nll(model, ids, FlexiCache.from_model(model, **settings), PREFILL))
        print(f"{name}: ppl {value:.3f} ({value / dense:.4f} x dense)", flush=True)


if __name__ == "__main__":
    main()
