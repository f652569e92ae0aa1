"""The evaluation curve PNG."""

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
