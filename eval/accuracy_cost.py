"""What accuracy costs: each page-selection setting's decode step (GPU) against its perplexity (real model, CPU).

The step is the setting's p50 over the p50 of the paper's setting (16-token pages, no standby pages: the suite's
``flexicache-1024`` when these runs were made) in the same GPU run (``flexicache bench --cases decode``,
Llama-3.1-8B shape, 32 layers, 32k x batch 8, budget 1024; folders under ``eval/results/gpu/``). The two
exact-rescoring settings were timed in a run without the paper's setting, beside 8-token pages with a quarter of K
on standby and box scores alone: their ratio is chained through that setting's in ``decode_standby``. The perplexity
is SmolLM2-135M's decode-mode perplexity over dense at budget 1/8 (``eval/results/cpu/levers/``, made by
``bash eval/run_cpu_results.sh eval/results/cpu levers``). Writes a PNG, prints the table and, with ``--update``,
puts it between the ``<!-- accuracy-cost -->`` markers of a markdown file (``eval/RESULTS.md``).

Usage: ``python eval/accuracy_cost.py [--out eval/results/accuracy_cost.png] [--update eval/RESULTS.md]``
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent / "results"
TARGET = 1.02  # the accuracy issue's perplexity target at budget 1/8: within +2% of dense
START, END = "<!-- accuracy-cost -->", "<!-- /accuracy-cost -->"


@dataclass(frozen=True)
class Setting:
    """One setting: its label (``short`` in the plot), where its step was timed (GPU folder, system) and its
    perplexity (CPU folder, row)."""

    label: str
    short: str
    gpu_run: str
    system: str
    cpu_folder: str
    method: str
    bridge: tuple[str, str] | None = None  # a run without the paper's setting: (a system of it, the same settings'
    # system in BRIDGE_RUN); its step ratio is then chained through that system's ratio in BRIDGE_RUN


BASELINE_SYSTEM = "flexicache-1024"  # 16-token pages, no standby pages, stable heads every 16 steps
BRIDGE_RUN = "decode_standby"
DEFAULTS = "K standby"  # the short label of the defaults with 2K candidates and K per head (drawn in orange)
QUARTER_BOX = ("flexicache-1024", "flexicache-1024:page_size=8,standby_pages=32")  # decode_exact's 8-token pages,
# a quarter of K on standby, box scores alone, and the same in BRIDGE_RUN
SETTINGS = (
    Setting("8-token pages, exact rescoring, K on standby (the defaults with 2K candidates, K per head) ¹",
            DEFAULTS, "decode_exact", "flexicache-1024:exact_rescore=true,standby_pages=128", "ppl-1.5k-exact-standby",
            "flexicache@192,exact_rescore=True,standby_pages=24", bridge=QUARTER_BOX),
    Setting("8-token pages, exact rescoring, a quarter of K on standby ¹", "exact K/4",
            "decode_exact", "flexicache-1024:exact_rescore=true", "ppl-1.5k-exact", "flexicache@192,exact_rescore=True",
            bridge=QUARTER_BOX),
    Setting("16-token pages, stable heads every 16 steps, no standby pages (the paper's)", "p16", "decode_standby",
            BASELINE_SYSTEM, "ppl-1.5k", "flexicache@192"),
    Setting("8-token pages, a quarter of K on standby (box scores alone)", "p8 standby K/4",
            "decode_standby", "flexicache-1024:page_size=8,standby_pages=32", "ppl-1.5k-page8",
            "flexicache@192,standby_pages=quarter"),
    Setting("8-token pages, half of K on standby", "p8 standby K/2", "decode_standby",
            "flexicache-1024:page_size=8,standby_pages=64", "ppl-1.5k-page8", "flexicache@192,standby_pages=12"),
    Setting("float8 host tier", "float8 tier", "host_dtype", "flexicache-1024:host_dtype=float8_e4m3fn", "ppl-1.5k",
            "flexicache@192,host_dtype=float8_e4m3fn"),
    Setting("stable heads every step", "/1", "decode_rerank_page", "flexicache-1024:rerank_interval=1", "ppl-1.5k",
            "flexicache@192,rerank_interval=1"),
    Setting("8-token pages", "p8", "decode_rerank_page", "flexicache-1024:page_size=8", "ppl-1.5k-page8",
            "flexicache@192"),
    Setting("8-token pages, every 4 steps", "p8 /4", "decode_rerank_page",
            "flexicache-1024:page_size=8,rerank_interval=4",
            "ppl-1.5k-page8", "flexicache@192,rerank_interval=4"),
    Setting("8-token pages, every 2 steps", "p8 /2", "decode_page8_ri2",
            "flexicache-1024:page_size=8,rerank_interval=2",
            "ppl-1.5k-page8", "flexicache@192,rerank_interval=2"),
    Setting("8-token pages, every 2 steps, float8 host tier", "p8 /2 float8", "decode_page8_ri2",
            "flexicache-1024:page_size=8,rerank_interval=2,host_dtype=float8_e4m3fn", "ppl-1.5k-page8",
            "flexicache@192,rerank_interval=2,host_dtype=float8_e4m3fn"),
    Setting("8-token pages, every step", "p8 /1", "decode_rerank_page", "flexicache-1024:page_size=8,rerank_interval=1",
            "ppl-1.5k-page8", "flexicache@192,rerank_interval=1"),
    # Limited promotions: the same share of the selection slots on the GPU (127 slots) as on the CPU (23).
    Setting("8-token pages, every 2 steps, at most 9% of the selection promoted", "p8 /2 <=9%", "decode_promotions",
            "flexicache-1024:page_size=8,rerank_interval=2,max_promotions=11", "ppl-1.5k-page8",
            "flexicache@192,rerank_interval=2,max_promotions=2"),
    Setting("8-token pages, every step, at most 9% promoted", "p8 /1 <=9%", "decode_promotions",
            "flexicache-1024:page_size=8,rerank_interval=1,max_promotions=11", "ppl-1.5k-page8",
            "flexicache@192,rerank_interval=1,max_promotions=2"),
    Setting("8-token pages, every step, at most 17% promoted", "p8 /1 <=17%", "decode_promotions",
            "flexicache-1024:page_size=8,rerank_interval=1,max_promotions=22", "ppl-1.5k-page8",
            "flexicache@192,rerank_interval=1,max_promotions=4"),
)
ORACLES = (("oracle pages, 16 tokens", "ppl-1.5k"), ("oracle pages, 8 tokens", "ppl-1.5k-page8"))
LABEL_OFFSETS = {DEFAULTS: (-8, -10), "exact K/4": (3, 5), "p8 /2 float8": (5, -10),
                  "p8 /1 <=9%": (5, 4), "p8 /1 <=17%": (5, -10), "p8 /2 <=9%": (6, -3),
                 "p8 standby K/4": (-8, 6), "p8 standby K/2": (-8, -10), "p8 /4": (5, 4)}
KEY = ("K standby: exact rescoring and K on standby (the defaults with 2K candidates, K per head); exact K/4: the "
       "same with a quarter of K (both timed in another run,\nchained through p8 standby K/4); p8: 8-token pages; "
       "/n: stable heads rerank every n steps; <=x%: at most x% of the selection promoted;\nstandby K/4: a quarter of "
       "K on standby; the points without 'exact' choose by box scores alone (exact_rescore=False)")


def step_ratio(run: str, system: str) -> tuple[float, float]:
    """``(p50 ms, p50 / the paper's setting's p50 in the same run)`` of ``system`` in GPU run folder ``run``."""
    p50 = decode_p50(run)
    return p50[system], p50[system] / p50[BASELINE_SYSTEM]


def decode_p50(run: str) -> dict[str, float]:
    """Each system's p50 decode step (ms) in GPU run folder ``run``."""
    rows = json.loads((ROOT / "gpu" / run / "bench.json").read_text())["cases"]["decode"]["rows"]
    return {row["system"]: row["step_ms_p50"] for row in rows}


def setting_step(setting: Setting) -> tuple[float, float]:
    """``(p50 ms in its own run, p50 / the paper's setting's)`` of ``setting``, chained through its bridge where its
    run has no paper's setting."""
    if setting.bridge is None:
        return step_ratio(setting.gpu_run, setting.system)
    own, (here, there) = decode_p50(setting.gpu_run), setting.bridge
    return own[setting.system], own[setting.system] / own[here] * step_ratio(BRIDGE_RUN, there)[1]


def perplexity_ratio(folder: str, method: str) -> float:
    """The decode-mode perplexity of ``method`` over dense's in CPU levers folder ``folder``."""
    metrics = json.loads((ROOT / "cpu" / "levers" / folder / "metrics.json").read_text())
    return metrics["tasks"]["ppl"]["ratio"][method]


def table() -> tuple[str, list[tuple[str, float, float]]]:
    """The markdown table and the ``(short label, step ratio, perplexity ratio)`` points."""
    lines = ["| setting | decode step, 32k x 8 (x 16-token pages' in the same run) | perplexity at 1/8 (x dense) |",
             "|---|---|---|"]
    points = []
    for setting in SETTINGS:
        ms, ratio = setting_step(setting)
        ppl = perplexity_ratio(setting.cpu_folder, setting.method)
        points.append((setting.short, ratio, ppl))
        lines.append(f"| {setting.label} | {ms:.2f} ms ({ratio:.2f}x) | {ppl:.3f} |")
    for label, folder in ORACLES:
        lines.append(f"| {label} (reads every key: a ceiling, not a setting) | - | "
                     f"{perplexity_ratio(folder, 'oracle@192'):.3f} |")
    lines.append("\n¹ timed in another run (`decode_exact`), beside 8-token pages with a quarter of K on standby and "
                 "box scores alone; the ratio is to that setting there times that setting's ratio here.")
    return "\n".join(lines), points


def plot(points: list[tuple[str, float, float]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    right = max(ratio for _, ratio, _ in points) * 1.45
    for label, ratio, ppl in points:
        ax.scatter(ratio, ppl, color="tab:orange" if label == DEFAULTS else "tab:blue",
                   s=60 if label == DEFAULTS else 30, zorder=3)
        offset = LABEL_OFFSETS.get(label, (5, 4))
        ax.annotate(label, (ratio, ppl), textcoords="offset points", xytext=offset, fontsize=7,
                    ha="right" if offset[0] < 0 else "left")
    for label, folder in ORACLES:
        level = perplexity_ratio(folder, "oracle@192")
        ax.axhline(level, color="grey", linestyle=":", linewidth=0.9)
        ax.annotate(label, (right, level), textcoords="offset points", xytext=(-4, -9), fontsize=7, color="grey",
                    ha="right")
    ax.axhline(TARGET, color="tab:red", linestyle="--", linewidth=0.9)
    ax.annotate("target: +2%", (right, TARGET), textcoords="offset points", xytext=(-4, 3), fontsize=7,
                color="tab:red", ha="right")
    ax.set_xlabel("decode step / 16-token pages' (GPU, Llama-3.1-8B shape, 32 layers, 32k x 8)")
    ax.set_ylabel("perplexity / dense (SmolLM2-135M, CPU, budget 1/8)")
    ax.set_title("What accuracy costs: page-selection settings", fontsize=9)
    fig.text(0.01, 0.01, KEY, fontsize=6.5, color="dimgrey")
    ax.grid(alpha=0.3)
    ax.set_xlim(0.9, right)
    ax.set_ylim(1.008, None)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def with_table(document: str, text: str) -> str:
    """``document`` with ``text`` between its accuracy-cost markers."""
    start, end = document.index(START) + len(START), document.index(END)
    return document[:start] + "\n" + text + "\n" + document[end:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "accuracy_cost.png")
    parser.add_argument("--update", type=Path, help="markdown file whose accuracy-cost block to rewrite")
    args = parser.parse_args()
    text, points = table()
    plot(points, args.out)
    print(text)
    print(f"\nwrote {args.out}")
    if args.update:
        args.update.write_text(with_table(args.update.read_text(), text))
        print(f"rewrote the accuracy-cost table of {args.update}")


if __name__ == "__main__":
    main()
