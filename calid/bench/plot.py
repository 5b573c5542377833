"""Plots for benchmark reports (matplotlib, no display needed)."""
from __future__ import annotations

from pathlib import Path


def quality_vs_filtered(rows: list[dict], path: Path) -> Path:
    """CALID Fig. 3 view: quality of each lossy configuration against the share of tokens from the draft."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [r for r in rows if isinstance(r.get("filtered_fraction"), float)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, label in zip(axes, ("pass_at_1", "agreement_with_ar", "target_nll"),
                              ("HumanEval pass@1", "prefix agreement with target greedy", "target NLL per token")):
        for r in points:
            ax.scatter(r["filtered_fraction"], r[key], s=40)
            ax.annotate(r["config"], (r["filtered_fraction"], r[key]), fontsize=7, xytext=(4, 3),
                        textcoords="offset points")
        ax.set_xlabel("filtered fraction (tokens from the draft)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle("Quality vs filtered fraction")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
