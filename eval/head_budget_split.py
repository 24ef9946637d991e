"""Experiment: the ceiling of splitting a layer's budget across its KV heads (FlexiCache's ``head_budgets="prompt"``
is the split fixed at the prompt), against the same budget for every head, as decode-mode perplexity of SmolLM2
with oracle pages.

Every row reads every key (oracle pages, :mod:`flexicache.oracle`); a head's mass is that of its GQA group, the same
total for every head:

- ``uniform``: every (request, KV head) attends to its own top ``K`` pages by true attention mass (the oracle rows of
  the tables);
- ``pooled``: at every step and in every layer, the ``H * K`` pages of most mass over all of a request's KV heads,
  each head's sink and tail forced: a head whose attention is spread takes pages from one whose attention sits on a
  few (the summed recall over the layer's heads is largest);
- ``prompt-split``: each head its own top ``K_h`` pages, the ``K_h`` (summing to ``H * K``, at least 2) fixed at the
  prompt so that the oracle pages' mean recall over the prompt's last 64 queries, summed over the heads, is largest:
  shapes fixed for the whole decode, as CUDA graphs want;
- ``*-candidates``: the same, each head choosing only among its top ``--candidates`` x ``K`` pages (2 by default) by
  FlexiCache's box scores, by its query heads' share of the attention over those candidates (what exact rescoring
  knows at a step).

Each file: its first ``--context`` tokens (1536), ``--prefill`` of them prefilled (1024), the rest scored one token
per forward; ``--budget`` 192 (1/8), 8-token pages; the ratio of a pair of files is the perplexity over both files'
tokens, as the tables'. Usage: ``python eval/head_budget_split.py [FILE ...] [--methods uniform pooled ...] [--model
qwen2.5-coder --context 2048 --prefill 1536 --budget 256]`` (standard-library file names; default the two pairs of
the perplexity tables: typing.py argparse.py dataclasses.py inspect.py; every method by default)
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache

from flexicache.evaluation.perplexity import decode_nll, perplexity, stdlib_file
from flexicache.head_budgets import prompt_page_gains, split_budget
from flexicache.models import load_model
from flexicache.oracle import OracleCache, OracleLayer, oracle_token_mask, page_mass
from flexicache.profiling.pages import tail_page_mass

PAGE_SIZE = 8
WINDOW = 64  # prompt-tail queries the prompt split reads


def pooled_token_mask(weights: torch.Tensor, page_size: int, pages: int, candidates: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """``[H, T]`` bool: the ``H * pages`` pages of most attention mass (``weights [H, G, T]`` summed over the group)
    over all heads together, among the pages ``candidates [H, P]`` (bool; ``None``: all), every head's first and last
    page forced."""
    heads, _, num_tokens = weights.shape
    num_pages = -(-num_tokens // page_size)
    if num_pages <= pages:
        return torch.ones(heads, num_tokens, dtype=torch.bool)
    mass = page_mass(weights, page_size)
    if candidates is not None:
        mass = mass.masked_fill(~candidates, -1.0)
    mass[:, 0] = mass[:, -1] = float("inf")
    top = mass.flatten().topk(heads * pages).indices
    chosen = torch.zeros(heads * num_pages, dtype=torch.bool).scatter_(0, top, True).view(heads, num_pages)
    return chosen.repeat_interleave(page_size, dim=1)[:, :num_tokens]


def candidate_shares(logits: torch.Tensor, candidates: torch.Tensor | None, page_size: int) -> torch.Tensor:
    """``[H, G, N]`` each query head's share of its attention over the pages ``candidates [H, P]`` (``None``: all),
    from ``logits [H, G, N]``: what exact rescoring knows at a step."""
    if candidates is not None:
        in_candidates = candidates.repeat_interleave(page_size, dim=1)[:, : logits.shape[-1]]
        logits = logits.masked_fill(~in_candidates.unsqueeze(1), float("-inf"))
    return logits.softmax(-1)


class PooledOracleLayer(OracleLayer):
    """Every step, the ``H * K`` pages of most mass over the layer's heads (:func:`pooled_token_mask`), by the
    :func:`candidate_shares`."""

    def token_mask(self, logits: torch.Tensor, candidates: torch.Tensor | None) -> torch.Tensor:
        return pooled_token_mask(candidate_shares(logits, candidates, self.settings.page_size),
                                 self.settings.page_size, self.settings.pages_per_head, candidates)


def prompt_head_pages(query: torch.Tensor, keys: torch.Tensor, page_size: int, pages: int, window: int = WINDOW
                      ) -> torch.Tensor:
    """``[H]`` pages per head, summing to ``H * pages`` (at least 2, at most the prompt's pages), chosen so that the
    mean recall of the oracle pages over the prompt's last ``window`` queries (``query [Hq, T, D]`` over ``keys [H,
    T, D]``, causal), summed over the heads, is largest: ``head_budgets="prompt"``'s split
    (:mod:`flexicache.head_budgets`) with the oracle's bounds."""
    heads, length, _ = keys.shape
    num_pages = -(-length // page_size)
    if num_pages <= pages:
        return torch.full((heads,), pages)
    gains = prompt_page_gains(tail_page_mass(query[None], keys[None], None, page_size, window), num_pages)[0]  # [H, P]
    return split_budget(gains, heads * pages, torch.full((heads,), 2), torch.full((heads,), num_pages))


class PromptSplitOracleLayer(OracleLayer):
    """Each head's own top ``K_h`` pages by the :func:`candidate_shares`, ``K_h`` fixed at the prompt
    (:func:`prompt_head_pages`)."""

    head_pages: torch.Tensor | None = None

    def commit(self, chunk, query: torch.Tensor, real_tokens: torch.Tensor | None) -> None:
        super().commit(chunk, query, real_tokens)
        if self.head_pages is None and chunk.keys.shape[2] > 1:
            self.head_pages = prompt_head_pages(query[0], chunk.keys[0], self.settings.page_size,
                                                self.settings.pages_per_head)

    def token_mask(self, logits: torch.Tensor, candidates: torch.Tensor | None) -> torch.Tensor:
        shares = candidate_shares(logits, candidates, self.settings.page_size)
        return torch.cat([oracle_token_mask(shares[h:h + 1], self.settings.page_size, int(pages),
                                            None if candidates is None else candidates[h:h + 1])
                          for h, pages in enumerate(self.head_pages)])


METHODS: dict[str, tuple[type[OracleLayer], bool]] = {  # name: (its paged layers, among the candidates)
    "uniform": (OracleLayer, False),
    "pooled": (PooledOracleLayer, False),
    "prompt-split": (PromptSplitOracleLayer, False),
    "uniform-candidates": (OracleLayer, True),
    "pooled-candidates": (PooledOracleLayer, True),
    "prompt-split-candidates": (PromptSplitOracleLayer, True),
}


def oracle_cache(config, budget: int, layer_type: type[OracleLayer], candidates: int) -> OracleCache:
    """An :class:`OracleCache` at ``budget`` (8-token pages) whose paged layers are ``layer_type``."""
    cache = OracleCache(config, token_budget=budget, page_size=PAGE_SIZE, candidates=candidates)
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, OracleLayer):
            cache.layers[index] = layer_type(index, layer.settings, candidates)
    return cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", default=["typing.py", "argparse.py", "dataclasses.py", "inspect.py"])
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--model", default="smollm2", help="a model name of flexicache.models (e.g. qwen2.5-coder)")
    parser.add_argument("--context", type=int, default=1536, help="tokens of each file")
    parser.add_argument("--prefill", type=int, default=1024, help="of them prefilled (the rest scored)")
    parser.add_argument("--budget", type=int, default=192)
    parser.add_argument("--candidates", type=int, default=2, help="the *-candidates rows' candidates, x K")
    args = parser.parse_args()
    model, tokenizer = load_model(args.model, device="cpu", dtype=torch.float32)
    scored: dict[str, dict[str, tuple[float, int]]] = {}  # file: method: (summed NLL, tokens)
    for name in args.files:
        ids = tokenizer(stdlib_file(name).read_text(), add_special_tokens=True).input_ids[: args.context]
        for method in ["dense", *args.methods]:
            cache = (DynamicCache(config=model.config) if method == "dense"
                     else oracle_cache(model.config, args.budget, METHODS[method][0],
                                       args.candidates if METHODS[method][1] else 0))
            scored.setdefault(name, {})[method] = decode_nll(model, ids, cache, args.prefill)
            print(f"{name} {method}: perplexity {perplexity(*scored[name][method]):.3f}", flush=True)
    for pair in zip(args.files[::2], args.files[1::2]):  # the tables' ratio: perplexity over both files' tokens
        pooled = {m: perplexity(sum(scored[f][m][0] for f in pair), sum(scored[f][m][1] for f in pair))
                  for m in ["dense", *args.methods]}
        row = ", ".join(f"{m} {pooled[m] / pooled['dense']:.3f}" for m in args.methods)
        print(f"{' + '.join(pair)} (x dense): {row}", flush=True)


if __name__ == "__main__":
    main()
