"""The convergence benchmark's plot (``bench/feedback_convergence.py``)."""

from __future__ import annotations

from pathlib import Path


def plot(results: list[dict], out: Path, ways: tuple[str, ...]) -> None:
    """Each scenario's first seed: the metric against global step, and against the seconds until
    each result was known (rows that have them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    firsts = {}
    for r in results:
        firsts.setdefault(r["scenario"], r)
    timed = all("known_at_s" in r["runs"]["none"] for r in firsts.values())
    fig, axes = plt.subplots(
        1 + timed, len(firsts), figsize=(4 * len(firsts), 3.4 * (1 + timed)), dpi=110, squeeze=False
    )
    for col, (scenario, r) in enumerate(firsts.items()):
        for way, style in zip(ways, ("k-", "C1--", "C0-", "C2:", "C3-."), strict=True):
            if way not in r["runs"]:  # rows recorded before the way was
                continue
            run = r["runs"][way]
            steps, values = zip(*run["curve"], strict=True)
            axes[0][col].plot(steps, values, style, marker=".", label=f"{way} ({run['steps']} steps)")
            if timed:
                known = dict(run["known_at_s"])  # in the order they were known (a look-back comes late)
                seconds, by_time = zip(*sorted((known[s], v) for s, v in run["curve"]), strict=True)
                axes[1][col].plot(seconds, by_time, style, marker=".", label=way)
        axes[0][col].set_title(f"{scenario} (seed {r['seed']})")
        axes[0][col].set_xlabel("global step")
        for row in axes[:, col]:
            row.legend(fontsize=7)
            row.set_ylabel(r["runs"]["none"]["metric"])
        if timed:
            axes[1][col].axhline(r["runs"]["sync"]["end"]["value"], color="C1", lw=0.6)
            axes[1][col].set_xlabel("seconds until the result was known")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
