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


def quality_curve(rows: list[dict], path: Path) -> Path:
    """calid bench quality: task quality, token match with the target and target NLL against the filtered
    fraction, one point per configuration, one panel row per task kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in ("humaneval", "math", "mtbench") if any(r["task"] == k for r in rows)]
    panels = (("quality", "pass@1 / exact match"), ("token_match", "tokens = target's top-1"),
              ("target_nll", "target NLL per token"))
    fig, axes = plt.subplots(max(1, len(kinds)), 3, figsize=(15, 3.6 * max(1, len(kinds))), squeeze=False)
    markers = "osD^v<>ph*Xd"
    for row_axes, kind in zip(axes, kinds):
        points = [r for r in rows if r["task"] == kind]
        for ax, (key, label) in zip(row_axes, panels):
            for i, r in enumerate(points):
                if isinstance(r.get(key), float):
                    ax.scatter(r["filtered_fraction"], r[key], s=40, marker=markers[i % len(markers)],
                               label=r["config"])
            ax.set_xlabel("filtered fraction (tokens from the draft)")
            ax.set_ylabel(f"{kind}: {label}")
            ax.set_xlim(-0.03, 1.03)
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels) or 1), fontsize=8, frameon=False)
    fig.subplots_adjust(bottom=0.16, hspace=0.35, wspace=0.3)
    fig.suptitle("Quality vs filtered fraction (calid bench quality)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def load_curves(rows: list[dict], loads: list[str], path: Path) -> Path:
    """Goodput and p99 TPOT of each mode against load (``loads``: the x axis, in order)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    by = {(r["load"], r["mode"]): r for r in rows}
    for ax, key, label in ((axes[0], "goodput_tok_s", "goodput (tokens/s within SLO)"),
                           (axes[1], "tpot_ms_p99", "TPOT p99 (ms)")):
        for mode in modes:
            ys = [by[(x, mode)][key] if (x, mode) in by else float("nan") for x in loads]
            ax.plot(range(len(loads)), ys, marker="o", label=mode)
        ax.set_xticks(range(len(loads)), loads)
        ax.set_xlabel("load (c<N>: N clients; trace replays: share of ar's capacity)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("Goodput and tail latency under load")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def attainment_views(sweeps: dict[str, list[dict]], path: Path) -> Path:
    """AlpaServe's three views: SLO attainment of each planner against rate, burstiness (CV) and SLO scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"load": "request rate (share of batch-1 capacity)", "cv": "CV of arrivals",
              "slo_scale": "SLO scale (x a request alone)"}
    fig, axes = plt.subplots(1, len(sweeps), figsize=(5.2 * len(sweeps), 4.2), squeeze=False)
    for ax, (key, rows) in zip(axes[0], sweeps.items()):
        planners = [k for k in rows[0] if k != key]
        for name in planners:
            ax.plot([r[key] for r in rows], [r[name] for r in rows], marker="o", label=name)
        ax.set_xlabel(labels.get(key, key))
        ax.set_ylabel("SLO attainment")
        ax.set_ylim(-0.02, 1.02)
        if key == "slo_scale":
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.suptitle("Placement: SLO attainment (simulated)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
