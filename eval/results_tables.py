"""The accuracy tables of eval/RESULTS.md, from the stored results folders (each folder's metrics.json and
config.json, as `flexicache eval` leaves them).

One table per folder: a row per (task, budget) with dense, FlexiCache at 8-token pages with a quarter of K on
standby (:data:`PAGE8_ROWS`, where the folder holds them), the oracle pages, FlexiCache at the folder's page size and
standby pages (the folder's ``--budget`` rows: 16-token pages without standby pages, the paper's stable heads, in
every folder here), Quest's bound (``spread_weight=1.0,principal_bounds=false``) and the variants of
:data:`VARIANTS` the folder holds, each as score and ratio to dense, the number of samples, and the folder's command;
for generated answers also how often each method's output is dense's, token for token; folders under ``levers/`` and
``profiles/`` get one row per method instead (every setting they compare).
``python eval/results_tables.py eval/results/cpu`` prints them; ``--update eval/RESULTS.md`` writes them between that
file's ``<!-- results-tables -->`` and ``<!-- /results-tables -->`` lines.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flexicache.config import FlexiCacheConfig

PAGE8_ROWS = ("flexicache@{budget},page_size=8,standby_pages=quarter", "FlexiCache, 8-token pages, K // 4 standby")
QUEST_SUFFIX = ",spread_weight=1.0,principal_bounds=False"
# rows a folder may hold beside its own: (method name at "{budget}", column header)
VARIANTS = (PAGE8_ROWS, ("flexicache@{budget},profile=online", "FlexiCache, head split from the prompt"),
            ("flexicache@{budget},rerank_warmup=16", "FlexiCache, `rerank_warmup=16`"))


def compared(budget: int, variants: list[str]) -> list[str]:
    """The methods of one budget's row after dense: :data:`PAGE8_ROWS` (where among ``variants``), the oracle pages, the
    folder's FlexiCache rows, Quest's bound and the other ``variants`` (method names at ``{budget}``)."""
    flexi = f"flexicache@{budget}"
    first = [variant for variant in variants if variant == PAGE8_ROWS[0]]
    rest = [variant for variant in variants if variant != PAGE8_ROWS[0]]
    return [*(variant.format(budget=budget) for variant in first), f"oracle@{budget}", flexi, flexi + QUEST_SUFFIX,
            *(variant.format(budget=budget) for variant in rest)]


def headers(folder_config: dict, variants: list[tuple[str, str]]) -> list[str]:
    """Column headers of :func:`compared`'s methods for a folder run at ``folder_config``'s page size, standby pages
    and page choice (every FlexiCache column of a folder run with ``exact_rescore=False`` says so)."""
    page_size = folder_config.get("page_size")
    standby = folder_config.get("standby_pages")
    box_scores = ", box scores alone" if folder_config.get("exact_rescore") is False else ""
    folder_rows = f"FlexiCache, {page_size}-token pages" + (", no standby" if standby == 0 else "") + box_scores
    if folder_config.get("profile") == "online":
        folder_rows += ", head split from the prompt"
    variants = [(template, header + box_scores if header.startswith("FlexiCache") else header)
                for template, header in variants]
    first = [header for template, header in variants if template == PAGE8_ROWS[0]]
    rest = [header for template, header in variants if template != PAGE8_ROWS[0]]
    return [*first, f"oracle pages ({page_size} tokens)", folder_rows, "Quest's bound", *rest]


def budgets_of(methods: list[str]) -> list[int]:
    """The budgets of the folder's FlexiCache rows, descending."""
    return sorted({int(m.split("@")[1].split(",")[0]) for m in methods if m.startswith("flexicache@")}, reverse=True)


def cell(task: dict, method: str, lower_is_better: bool) -> str:
    """``score (ratio)`` of one method, or ``-``."""
    score = task["score"].get(method)
    if score is None:
        return "-"
    ratio = task["ratio"].get(method)
    text = f"{score:.2f}" if lower_is_better else f"{score:.1f}"
    return text if ratio is None else f"{text} ({ratio:.3f})"


def _option_value(value: object) -> str:
    """A recorded setting as the command line spells it (booleans ``true``/``false``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def command_of(config: dict) -> str:
    """The ``flexicache eval`` command a folder's config.json records: the options it was run with (the cache
    settings, the decode tail, chat, batch size and stop strings where they differ from the defaults; the dtype and
    device are those of the table's page)."""
    parts = ["flexicache eval", f"--suite {config['suite']}", f"--model {config['model']}"]
    for key in ("gguf_file", "tasks", "lengths", "data", "limit", "context_length", "prefill", "max_new_tokens",
                "budget", "method", "profile", "page_size", "rerank_interval", "standby_pages", "exact_rescore",
                "stop_strings"):
        value = config.get(key)
        if value is None or value == [] or value == getattr(FlexiCacheConfig, key, None):
            continue
        if key == "prefill" and config["suite"] != "ppl":
            continue
        values = value if isinstance(value, list) else [value]
        values = [Path(str(v)).name if key == "data" else _option_value(v) for v in values]
        parts.append(f"--{key.replace('_', '-')} {' '.join(values)}")
    if config.get("seed"):  # 0 is the default
        parts.append(f"--seed {config['seed']}")
    if config.get("decode_tail"):
        parts.append(f"--decode-tail {config['decode_tail']}")
    if config.get("chat", "auto") != "auto":
        parts.append(f"--chat {config['chat']}")
    if config.get("batch_size", 1) != 1:
        parts.append(f"--batch-size {config['batch_size']}")
    for flag in ("longbench_e", "no_shared_prefill"):
        if config.get(flag):
            parts.append(f"--{flag.replace('_', '-')}")
    if config.get("oracle"):
        parts.append("--oracle")
    if config.get("oracle_candidates"):
        parts.append("--oracle-candidates " + " ".join(str(n) for n in config["oracle_candidates"]))
    parts.append(f"--out {config['out']}")
    return " ".join(parts)


def table(folder: Path) -> str:
    """The markdown table of one results folder."""
    metrics = json.loads((folder / "metrics.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    budgets = budgets_of(metrics["methods"])
    variants = [(template, header) for template, header in VARIANTS
                if any(template.format(budget=budget) in metrics["methods"] for budget in budgets)]
    columns = headers(config, variants)
    lines = ["| task | budget | n | dense | " + " | ".join(columns) + " |", "|---|---|---|---|" + "---|" * len(columns)]
    templates = [template for template, _ in variants]
    for name, task in metrics["tasks"].items():
        lower = task["kind"] == "perplexity"
        for budget in budgets:
            methods = compared(budget, templates)
            samples = next((task["n"][method] for method in methods if method in task["n"]), "-")  # the row's first
            lines.append(" | ".join([
                f"| {name}", f"{budget}", str(samples), cell(task, "dense", lower),
                *(cell(task, method, lower) for method in methods)]) + " |")
    fidelity = [fidelity_row(name, task, budget, compared(budget, templates))
                for name, task in metrics["tasks"].items() if task.get("fidelity") for budget in budgets]
    if fidelity:
        lines += ["", "Outputs identical to dense's (share of samples; ROUGE-L against dense's outputs):", "",
                  "| task | budget | " + " | ".join(columns) + " |", "|---|---|" + "---|" * len(columns), *fidelity]
    return "\n".join(lines) + f"\n\n`{command_of(config)}`"


def fidelity_row(name: str, task: dict, budget: int, methods: list[str]) -> str:
    """``identical (ROUGE-L)`` against dense of each of ``methods`` at ``budget``."""
    cells = []
    for method in methods:
        entry = task["fidelity"].get(method)
        cells.append("-" if not entry else f"{entry['identical']:.2f} ({entry['rouge_l_vs_dense']:.2f})")
    return f"| {name} | {budget} | " + " | ".join(cells) + " |"


def lever_table(folder: Path) -> str:
    """One row per method (every FlexiCache setting the folder holds), one column per task: score (ratio)."""
    metrics = json.loads((folder / "metrics.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    tasks = metrics["tasks"]
    lines = ["| method | " + " | ".join(tasks) + " |", "|---" * (len(tasks) + 1) + "|"]
    for method in metrics["methods"]:
        lines.append(f"| {method} | " + " | ".join(
            cell(task, method, task["kind"] == "perplexity") for task in tasks.values()) + " |")
    return "\n".join(lines) + f"\n\n`{command_of(config)}`"


BEGIN, END = "<!-- results-tables -->", "<!-- /results-tables -->"


def all_tables(root: Path) -> str:
    """Every folder's table under a heading ``### <model>: <run>``."""
    sections = []
    for folder in sorted(path.parent for path in root.glob("*/*/metrics.json")):
        render = lever_table if folder.parent.name in ("levers", "profiles") else table
        sections.append(f"### {folder.parent.name}: {folder.name}\n\n{render(folder)}\n")
    return "\n".join(sections)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("root", help="the folder holding <model>/<run>/ results folders")
    parser.add_argument("--update", help="a markdown file whose results-tables block to rewrite")
    args = parser.parse_args()
    tables = all_tables(Path(args.root))
    if not args.update:
        print(tables)
        return
    path = Path(args.update)
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} block to rewrite")
    head, rest = text.split(BEGIN, 1)
    path.write_text(head + BEGIN + "\n" + tables + rest[rest.index(END):])


if __name__ == "__main__":
    main()
