"""PNG plots of a profile (matplotlib, Agg backend): stability heatmap and RCO versus step distance."""

from __future__ import annotations

import os
from pathlib import Path

from flexicache.plotting import pyplot
from flexicache.profile import HeadProfile


def plot_stability_heatmap(profile: HeadProfile, path: str | os.PathLike) -> Path:
    """Layers x KV heads heatmap of the stability scores (blank: layers the profile does not cover, e.g. sliding-window
    layers); unstable heads are marked with a cross."""
    if profile.scores is None:
        raise ValueError("The profile has no per-head scores to plot; profile the model with `flexicache profile`.")
    plt = pyplot()
    width = max(3.5, 0.9 * profile.num_kv_heads + 2.0)
    height = max(3.0, 0.22 * profile.num_layers + 1.5)
    fig, ax = plt.subplots(figsize=(width, height))
    image = ax.imshow(profile.score_matrix().numpy(), aspect="auto", cmap="viridis", interpolation="nearest")
    for layer, head in profile.unstable_heads:
        ax.plot(head, layer, marker="x", color="red", markersize=6, linestyle="none")
    ax.set_xlabel("KV head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(profile.num_kv_heads))
    ax.set_title(f"{profile.model or 'model'}\nstability score (x: unstable)", fontsize=9)
    fig.colorbar(image, ax=ax, label="mean RCO")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_rco_curves(profile: HeadProfile, path: str | os.PathLike) -> Path:
    """Mean RCO versus step distance of stable and unstable heads (band: one standard deviation across heads)."""
    curves = profile.calibration.get("reports", {}).get("rco_vs_distance")
    if not curves:
        raise ValueError("The profile has no rco_vs_distance report to plot.")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.0, 3.5))
    distance = curves["distance"]
    for name, color in (("stable", "tab:blue"), ("unstable", "tab:red")):
        if f"{name}_mean" not in curves:
            continue
        mean, std = curves[f"{name}_mean"], curves[f"{name}_std"]
        ax.plot(distance, mean, marker="o", markersize=3, color=color, label=f"{name} heads")
        low = [m - s for m, s in zip(mean, std, strict=True)]
        high = [m + s for m, s in zip(mean, std, strict=True)]
        ax.fill_between(distance, low, high,
                        color=color, alpha=0.2)
    ax.set_xlabel("step distance d")
    ax.set_ylabel("random-corrected overlap")
    ax.set_ylim(top=1.0)
    ax.set_title(f"{profile.model or 'model'}: top-{(profile.token_budget or 0) // (profile.page_size or 1)} "
                 "page sets", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_profile(profile: HeadProfile, directory: str | os.PathLike, stem: str) -> list[Path]:
    """Write ``{stem}.heatmap.png`` and ``{stem}.rco.png`` into ``directory`` (created if missing)."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    return [
        plot_stability_heatmap(profile, folder / f"{stem}.heatmap.png"),
        plot_rco_curves(profile, folder / f"{stem}.rco.png"),
    ]
