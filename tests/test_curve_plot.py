"""The evaluation curve PNG."""

import warnings

from areal_eval.curve_plot import plot_curve
from areal_eval.runs.ledger import LedgerEntry


def test_plot_marks_evaluated_and_skipped(tmp_path):
    entries = [
        LedgerEntry(0, "/c0", "evaluated", metrics={"accuracy": 0.5}),
        LedgerEntry(25, "/c25", "skipped", "plateau"),
        LedgerEntry(50, "/c50", "superseded", "behind"),
        LedgerEntry(75, "/c75", "failed", "corrupt"),
        LedgerEntry(100, "/c100", "evaluated", metrics={"accuracy": 0.8}),
    ]
    out = plot_curve(entries, "accuracy", tmp_path / "curve.png", "run")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_a_run_with_nothing_decided_plots_without_a_warning(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warned "No artists with labels found to put in legend"
        out = plot_curve([], "accuracy", tmp_path / "curve.png", "run")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
