"""What the feedback rules would have done on recorded curves (shadow mode, offline), judged in
the order a policy evaluated, as the pipeline issues directives; and ``areal-eval replay
--feedback``."""

import json

import pytest

from areal_eval import cli
from areal_eval.feedback import FeedbackConfig
from areal_eval.scheduling.curves import Curve, Point
from areal_eval.scheduling.feedback_replay import acted, feedback_scores


def curve(values, se=0.01):
    return Curve("c", True, tuple(Point(i * 10, v, se) for i, v in enumerate(values)))


def test_a_plateau_is_acted_on_when_its_newest_result_arrives_and_not_after_the_final_checkpoint():
    flat = curve([0.5, 0.6, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7])
    every = [(i, i) for i in range(11)]
    assert acted(flat, every, FeedbackConfig(patience=3, cooldown=2)) == [
        ("lr_scale", 5, 5),
        ("lr_scale", 8, 8),
    ]  # the stop that would follow at 11 is past the final checkpoint (10)
    # Evaluated late (a refinement after the end): nothing, training is over by then.
    assert acted(flat, [(i, i) for i in range(4)] + [(4, 10), (5, 10)], FeedbackConfig(patience=3)) == []
    assert acted(curve([0.5, 0.6, 0.7, 0.8, 0.9, 1.0]), [(i, i) for i in range(6)], FeedbackConfig()) == []


def test_a_collapse_is_rolled_back_on_its_second_result_below_the_best():
    collapse = curve([0.5, 0.6, 0.7, 0.8, 0.81, 0.6, 0.5, 0.45, 0.4, 0.4, 0.4])
    assert acted(collapse, [(i, i) for i in range(11)], FeedbackConfig(patience=None)) == [("rollback", 6, 6)]


def test_scores_count_curves_first_actions_and_drops():
    flat = curve([0.5, 0.6, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7])
    runs = [(flat, None, [("lr_scale", 5, 5)]), (flat, None, [])]
    assert feedback_scores(runs) == {
        "lr_scale": {"acted_per_100_curves": 50.0, "mean_first_at": 0.5},
        "rollback": {"acted_per_100_curves": 0.0},
        "stop": {"acted_per_100_curves": 0.0},
    }
    dropped = feedback_scores([(flat, 4, [("lr_scale", 5, 5)])])
    assert dropped["lr_scale"]["acted_within_2_of_drop"] == 1.0 and dropped["stop"]["acted_within_2_of_drop"] == 0.0


def test_replay_reports_the_feedback_rules_on_the_policies_results(tmp_path, capsys):
    path = tmp_path / "curves.jsonl"
    points = [{"step": i * 10, "value": v, "stderr": 0.01} for i, v in enumerate([0.5, 0.6] + [0.7] * 9)]
    path.write_text(json.dumps({"curve": "flat", "higher_is_better": True, "points": points}) + "\n")
    assert cli.main(["replay", str(path), "--policy", "fixed:1", "--feedback", "patience=2,cooldown=1", "--json"]) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[-1])["policies"]["fixed:1"]
    assert row["feedback"]["lr_scale"] == {"acted_per_100_curves": 100.0, "mean_first_at": 0.4}
    with pytest.raises(SystemExit):
        cli.main(["replay", str(path), "--feedback", "factor=2"])
    assert "factor" in capsys.readouterr().err
