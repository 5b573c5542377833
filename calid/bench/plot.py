"""Plots for benchmark reports (matplotlib, no display needed)."""
from __future__ import annotations

from pathlib import Path


def quality_vs_filtered(rows: list[dict], path: Path) -> Path:
    """CALID Fig. 3 view: quality of each lossy configuration against the share of tokens from the draft."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [r for r in rows if isinstance(r.get("filtered_fraction"), float)]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    panels = (("pass_at_1", "HumanEval pass@1", (0, 1.02)),
              ("agreement_with_ar", "prefix agreement with target greedy", (0, 1.02)),
              ("target_nll", "target NLL per token (lower is closer)", None))
    markers = "osD^v<>ph*"
    for ax, (key, label, ylim) in zip(axes, panels):
        for i, r in enumerate(points):
            if isinstance(r.get(key), float):
                ax.scatter(r["filtered_fraction"], r[key], s=45, marker=markers[i % len(markers)], label=r["config"])
        ax.set_xlabel("filtered fraction (tokens from the draft)")
        ax.set_ylabel(label)
        ax.set_xlim(-0.03, 1.03)
        if ylim:
            ax.set_ylim(*ylim)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(5, len(labels)), fontsize=8, frameon=False)
    fig.subplots_adjust(bottom=0.3)
    fig.suptitle("Quality vs filtered fraction")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
