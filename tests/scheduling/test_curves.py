"""Curve files: what `read_curves` reads, and every way a file can be refused, naming the file,
line, point and field."""

import json

import pytest

from areal_eval import cli
from areal_eval.scheduling.curves import DEFAULT_STDERR, read_curves


def test_bad_curve_file_names_the_line(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text('{"curve": "a", "points": [{"step": 1, "value": 0.5}]}\n{"curve": "b"}\n')
    with pytest.raises(ValueError, match="c.jsonl:2"):
        read_curves(f)
    assert cli.main(["replay", str(f)]) == 2
    assert cli.main(["replay", str(tmp_path / "missing.jsonl")]) == 2


@pytest.mark.parametrize(
    "point", [{"value": "NaN"}, {"value": "Infinity"}, {"stderr": -0.01}, {"stderr": "NaN"}], ids=str
)
def test_a_point_that_no_score_can_use_is_refused_naming_line_and_point(tmp_path, point):
    f = tmp_path / "c.jsonl"
    good = {"step": 0, "value": 0.5, "stderr": 0.01}
    bad = {**good, "step": 5, **point}
    f.write_text(
        "".join(
            json.dumps({"curve": name, "points": points}) + "\n" for name, points in [("a", [good]), ("b", [good, bad])]
        )
    )
    with pytest.raises(ValueError, match=r"c.jsonl:2: point 1 \(step 5\)"):
        read_curves(f)


@pytest.mark.parametrize(
    "points, named",
    [
        ([], r"c.jsonl:1: curve 'a' has no points"),
        ([{"step": 5, "value": 0.5}, {"step": 5, "value": 0.6}], r"point 1 \(step 5\) must come after step 5"),
        ([{"step": 5, "value": 0.5}, {"step": 2, "value": 0.6}], r"c.jsonl:1: point 1 \(step 2\) must come after"),
    ],
)
def test_a_curve_without_points_or_with_steps_out_of_order_is_refused_naming_the_point(tmp_path, points, named):
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps({"curve": "a", "points": points}) + "\n")
    with pytest.raises(ValueError, match=named):
        read_curves(f)


GOOD = {"step": 0, "value": 0.5, "stderr": 0.01}


@pytest.mark.parametrize(
    "line, named",
    [
        ([1, 2], r'c.jsonl:1: a curve is a JSON object \({"curve", "points": \[...\]}\), got list'),
        ({"points": [GOOD]}, r"c.jsonl:1: needs 'curve', the curve's name"),
        (
            {"curve": "a", "higher_is_better": "no", "points": [GOOD]},
            r"'higher_is_better' must be true or false, got 'no'",
        ),
        ({"curve": "a", "points": {"step": 0}}, r"c.jsonl:1: 'points' must be a list of points"),
        ({"curve": "a", "subset_fraction": 2, "points": [GOOD]}, r"'subset_fraction' must be a number in \(0, 1\]"),
        ({"curve": "a", "subset_fraction": "NaN", "points": [GOOD]}, r"'subset_fraction' must be a number in"),
        ({"curve": "a", "subset_fraction": 0.2, "points": [GOOD]}, r"point 0 \(step 0\): 'subset_value' must be a"),
        ({"curve": "a", "points": [GOOD, 7]}, r"c.jsonl:1: point 1: a point is a JSON object"),
        ({"curve": "a", "points": [{**GOOD, "step": 1.5}]}, r"point 0: 'step' must be an integer, got 1.5"),
        ({"curve": "a", "points": [{**GOOD, "step": True}]}, r"point 0: 'step' must be an integer, got True"),
        (
            {"curve": "a", "points": [{**GOOD, "value": "0.5"}]},
            r"point 0 \(step 0\): 'value' must be a number, got '0.5'",
        ),
        ({"curve": "a", "points": [{**GOOD, "items": []}]}, r"'items' must be a non-empty list of scores, got \[\]"),
        ({"curve": "a", "points": [{**GOOD, "items": [1, None]}]}, r"'items' must all be scores \(numbers\), got None"),
        ({"curve": "a", "points": [GOOD], "train": {"loss": 1}}, r"c.jsonl:1: 'train' must be a list of rows"),
        ({"curve": "a", "points": [GOOD], "train": [{"loss": 1}]}, r"train row 0: 'step' must be an integer, got None"),
    ],
    ids=str,
)
def test_a_line_that_is_no_curve_is_refused_naming_line_point_and_field(tmp_path, line, named):
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=named):
        read_curves(f)
    assert cli.main(["replay", str(f)]) == 2  # a message, not a traceback


def test_two_curves_of_one_name_are_refused_naming_both_lines(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text("".join(json.dumps({"curve": name, "points": [GOOD]}) + "\n" for name in ("a", "b", "a")))
    with pytest.raises(ValueError, match=r"c.jsonl:3: curve 'a' is on line 1 too"):
        read_curves(f)


def test_what_a_curve_file_may_leave_out_or_spell_its_own_way(tmp_path):
    """No stderr (or 0) is the default; an integral float step is that step; true and false
    as item scores are 1 and 0; higher_is_better defaults to true."""
    f = tmp_path / "c.jsonl"
    points = [
        {"step": 0, "value": 0.5, "items": [True, False]},
        {"step": 10.0, "value": 1.0, "stderr": 0, "items": [1, 1]},
    ]
    f.write_text(json.dumps({"curve": "a", "points": points}) + "\n")
    (curve,) = read_curves(f)
    assert curve.higher_is_better and [p.step for p in curve.points] == [0, 10]
    assert [p.stderr for p in curve.points] == [DEFAULT_STDERR] * 2 and curve.points[0].items == (1.0, 0.0)
    assert curve.train == ()  # no training rows


def test_training_rows_are_read_in_step_order(tmp_path):
    f = tmp_path / "c.jsonl"
    train = [{"step": 20, "loss": 0.4}, {"step": 10, "loss": 0.5, "lr": 0.001}]
    f.write_text(json.dumps({"curve": "a", "points": [GOOD], "train": train}) + "\n")
    (curve,) = read_curves(f)
    assert curve.train == ({"step": 10, "loss": 0.5, "lr": 0.001}, {"step": 20, "loss": 0.4})
