"""The evaluation curve of a run as a PNG, for MLflow and the Prefect UI."""

from __future__ import annotations

from pathlib import Path

from areal_eval.disk import writing
from areal_eval.runs.ledger import LedgerEntry


def plot_curve(entries: list[LedgerEntry], metric: str, out: str | Path, title: str = "") -> Path:
    """The evaluation curve as a PNG: metric against step, evaluated and skipped checkpoints marked."""
    import matplotlib

    matplotlib.use("Agg")  # no display on workers
    import matplotlib.pyplot as plt

    evaluated = [(e.step, e.metrics[metric]) for e in entries if e.status == "evaluated" and metric in e.metrics]
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    if evaluated:
        ax.plot(*zip(*evaluated, strict=False), "o-", color="tab:blue", label=f"evaluated ({len(evaluated)})")
    markers = {"skipped": ("|", "tab:gray"), "superseded": ("x", "tab:orange"), "failed": ("X", "tab:red")}
    for status, (marker, color) in markers.items():
        steps = [e.step for e in entries if e.status == status]
        if steps:
            ax.plot(
                steps,
                [0.0] * len(steps),
                marker,
                color=color,
                markersize=9,
                transform=ax.get_xaxis_transform(),
                clip_on=False,
                linestyle="none",
                label=f"{status} ({len(steps)})",
            )
    ax.set_xlabel("global step")
    ax.set_ylabel(metric)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a run with nothing decided yet has nothing to name
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    out = Path(out)
    with writing(out, "the evaluation curve"):
        fig.savefig(out)
    plt.close(fig)
    return out
