"""A small dense vs FlexiCache accuracy comparison through the evaluation harness API.

The harness runs every sample under a dense ``DynamicCache`` and under FlexiCache at each ``--budget`` on the same
model (each a "method": a small object that builds a fresh cache per sample, so any FlexiCache settings can be a
row of the table), generates through ``model.generate``, scores with the package's offline ``evaluate`` modules
(RULER string match for the synthetic tasks) and reports, per task, the score of each method, its ratio to dense,
and its fidelity to the dense output (ROUGE-L against the dense answer). Offline on the CPU:

    python examples/evaluate_model.py                                   # passkey + needle, 1k tokens, 2 samples
    python examples/evaluate_model.py --lengths 2048 4096 --limit 5 --budget 128 256 --out eval-small

The same run from the command line, with every suite (LongBench, L-Eval, perplexity, code):

    flexicache eval --suite synthetic --model smollm2 --tasks passkey niah_single_1 --lengths 1024 \\
        --limit 2 --budget 128 --out eval-small

Re-running with the same ``--out`` resumes: samples already predicted are read back, not recomputed.
"""

from __future__ import annotations

import argparse
import time

import torch

from flexicache import HeadProfile
from flexicache.cli import DTYPE_HELP, DTYPES, resolve_device, resolve_dtype
from flexicache.evaluation import synthetic
from flexicache.evaluation.methods import DenseMethod, FlexiCacheMethod
from flexicache.evaluation.runner import format_table, run_tasks
from flexicache.models import SMOLLM2, load_model
from flexicache.profiles import shipped_profile_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=SMOLLM2, help="hub id, local folder, or 'smollm2' (offline, default)")
    parser.add_argument("--gguf-file", default=None)
    parser.add_argument("--tasks", nargs="+", default=["passkey", "niah_single_1"],
                        help=f"synthetic tasks: {', '.join(synthetic.SYNTHETIC_TASKS)}")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024], help="prompt lengths in tokens")
    parser.add_argument("--limit", type=int, default=2, help="samples per task and length")
    parser.add_argument("--budget", type=int, nargs="+", default=[128], help="FlexiCache token budgets")
    parser.add_argument("--profile", default=None,
                        help="HeadProfile JSON (default: the shipped one for smollm2, else HeadProfile.default)")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="cap on each task's answer length")
    parser.add_argument("--decode-tail", type=int, default=0,
                        help="feed the prompt's last N tokens one at a time, so the question is read sparsely too")
    parser.add_argument("--batch-size", type=int, default=1, help="equal-length prompts generated together")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help=DTYPE_HELP)
    parser.add_argument("--out", default="eval-example-results", help="results folder (re-running resumes)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    start = time.perf_counter()
    device = resolve_device(args.device)
    model, tokenizer = load_model(args.model, gguf_file=args.gguf_file, device=device,
                                  dtype=getattr(torch, resolve_dtype(args.dtype, device)))
    print(f"loaded {args.model} on {model.device} in {time.perf_counter() - start:.1f} s")
    shipped = shipped_profile_path("smollm2-135m-instruct") if args.model == SMOLLM2 else None
    profile_path = args.profile or shipped
    profile = HeadProfile.load(profile_path) if profile_path else None
    print(f"profile: {profile_path or 'none (unstable heads estimated from each prompt)'}")

    tasks = synthetic.build_tasks(tokenizer, args.tasks, args.lengths, args.limit, seed=args.seed,
                                  max_new_tokens=args.max_new_tokens)

    methods = [DenseMethod(model)]  # one row each; names: dense, flexicache@128, ...
    profile_name = args.profile or ("shipped:smollm2-135m-instruct" if shipped else "online")  # kept in methods.json
    methods += [FlexiCacheMethod(model, {"token_budget": budget}, profile, profile_name) for budget in args.budget]
    start = time.perf_counter()
    summary = run_tasks(model, tokenizer, tasks, methods, args.out, decode_tail=args.decode_tail,
                        batch_size=args.batch_size)
    print(f"\n{sum(len(t.samples) for t in tasks)} samples x {len(methods)} methods in "
          f"{time.perf_counter() - start:.1f} s\n")
    print(format_table(summary))
    print("\nscore: share of the reference answers found (x100); ratio: method / dense; fidelity: ROUGE-L of the "
          "method's answer against the dense answer (1 = same words)")
    for name, task in summary["tasks"].items():
        for method, stats in task["stats"].items():
            if "device_kv_bytes" in stats:
                print(f"{name} {method}: device KV {stats['device_kv_bytes'] / stats['dense_kv_bytes']:.1%} of dense, "
                      f"{stats['promoted_pages']:.0f} pages promoted per sample")
    print(f"\nresults in {args.out}/ (predictions/, metrics.json, table.md)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
