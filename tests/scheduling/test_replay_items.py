"""Replay on item-level curves: each point's per-item scores, regressions injected into the
items, probes on real subsets, and alerts judged paired on them."""

import json
import math
import statistics
from pathlib import Path

import pytest

from areal_eval.scheduling import replay
from areal_eval.scheduling.curves import Curve, Point, read_curves
from areal_eval.scheduling.replay import FixedEvery

DEMO_CURVES = Path(__file__).resolve().parents[2] / "bench" / "curves" / "areal-demo.jsonl"
GEOMETRIC_CURVES = DEMO_CURVES.with_name("areal-demo-geometric.jsonl")


def item_curve(tmp_path, points):
    path = tmp_path / "items.jsonl"
    path.write_text(json.dumps({"curve": "c", "higher_is_better": True, "points": points}) + "\n")
    return path


def test_points_that_disagree_on_their_items_are_refused_naming_curve_and_point(tmp_path):
    points = [{"step": 0, "value": 0.5, "stderr": 0.1, "items": [1, 0]}, {"step": 5, "value": 1, "items": [1, 1, 1]}]
    with pytest.raises(ValueError, match=r"items.jsonl:1: curve 'c' point 1 \(step 5\) has 3 items, point 0 has 2"):
        read_curves(item_curve(tmp_path, points))
    points[1]["items"] = None
    with pytest.raises(ValueError, match=r"point 1 \(step 5\) has no items, point 0 has 2"):
        read_curves(item_curve(tmp_path, points))
    points[1]["items"] = [1, "NaN"]
    with pytest.raises(ValueError, match=r"items.jsonl:1: point 1 \(step 5\): item 1 is nan: every score is finite"):
        read_curves(item_curve(tmp_path, points))


def test_an_injected_regression_lowers_items_by_the_stated_stderrs_and_probes_score_real_subsets():
    import random
    import statistics

    from areal_eval.scheduling.probes import probe_items, subset_result

    rng = random.Random(1)
    binary = [tuple(float(rng.random() < 0.6) for _ in range(200)) for _ in range(6)]
    points = tuple(Point(s, statistics.fmean(v), statistics.stdev(v) / 200**0.5, items=v) for s, v in enumerate(binary))
    curve = Curve("c", True, points)
    hit, start = replay.inject_regression(curve, random.Random(0))
    for before, after in zip(curve.points[start:], hit.points[start:], strict=True):
        drop = before.value - after.value
        noise = max(before.stderr, statistics.stdev(after.items) / 200**0.5)  # of the clean and the regressed
        assert replay.REGRESSION_STDERRS * noise <= drop < replay.REGRESSION_STDERRS * noise + 1 / 200
        assert after.value == pytest.approx(statistics.fmean(after.items))
        # The stderr an evaluator would report from the regressed items, on the curve's own scale.
        spread = statistics.stdev(after.items) / statistics.stdev(before.items)
        assert after.stderr == pytest.approx(before.stderr * spread)
        assert all(a <= b for a, b in zip(after.items, before.items, strict=True))  # items only got worse
    assert hit.points[:start] == curve.points[:start]
    # A result at its bound (every answer right, stderr 0) still drops by 5 of the regressed stderrs.
    perfect = Point(0, 1.0, 0.0, items=(1.0,) * 200)
    lowered = replay.lower_items(perfect, list(range(200)), -1.0)
    regressed_stderr = statistics.stdev(lowered.items) / 200**0.5
    assert replay.REGRESSION_STDERRS * regressed_stderr <= 1.0 - lowered.value < 0.2
    assert lowered.stderr == pytest.approx(regressed_stderr)
    value, _ = subset_result(curve, 2, 0.2, "0")
    assert value == statistics.fmean(binary[2][j] for j in probe_items(200, 0.2))


def test_a_drop_that_leaves_every_item_at_the_worst_score_replays(tmp_path):
    """On a few items a 5-stderr drop can take every one to 0: their spread, and so the stderr
    an evaluator reports, is 0, which counts as the default, as in a curve file."""
    import random

    from areal_eval.alerts import NOISE_AWARE_REGRESSION, AlertRule
    from areal_eval.scheduling.curves import DEFAULT_STDERR

    points = [{"step": s, "value": 0.5, "stderr": 0.25, "items": [0.0, 1.0, 1.0, 0.0]} for s in range(6)]
    curves = read_curves(item_curve(tmp_path, points))
    hit, start = replay.inject_regression(curves[0], random.Random(0))
    assert all(p.items == (0.0,) * 4 and p.stderr == DEFAULT_STDERR for p in hit.points[start:])
    rules = [AlertRule("default", "regression", **NOISE_AWARE_REGRESSION)]
    policies = [replay.parse_policy("adaptive"), FixedEvery(1)]
    for use_items in (True, False):
        for row in replay.replay(curves, policies, regression=True, seed=0, alert_rules=rules, use_items=use_items)[
            "policies"
        ].values():
            assert math.isfinite(row["mean_tracking_error"]) and "detected_within_2" in row["alerts"]["default"]


def test_paired_alerts_on_our_item_curves_see_injected_drops_the_unpaired_rule_misses():
    """The recorded curves keep every item's score: a regression rule judged by the paired error
    of the differences detects injected 5-stderr drops that the same rule judged by the two
    results' own errors misses, and fires on no more clean curves."""

    from areal_eval.alerts import AlertRule

    curves = read_curves(DEMO_CURVES)
    assert all(p.items is not None for c in curves for p in c.points)
    rule = AlertRule("noise_aware", "regression", stderrs=5.0, baseline_results=3)
    policies = [replay.parse_policy("fixed:1")]
    scores = {}
    for name, use_items in (("paired", True), ("unpaired", False)):  # the same drops, with items and without
        injected = [
            replay.replay(curves, policies, regression=True, seed=seed, alert_rules=[rule], use_items=use_items)[
                "policies"
            ]["fixed:1"]
            for seed in range(10)
        ]
        clean = replay.replay(curves, policies, regression=False, seed=0, alert_rules=[rule], use_items=use_items)[
            "policies"
        ]["fixed:1"]
        detected = statistics.fmean(r["alerts"]["noise_aware"]["detected_within_2"] for r in injected)
        scores[name] = detected, clean["alerts"]["noise_aware"]["false_alerts_per_100_curves"]
    # Measured: 1.0 of the drops paired, 0.025 unpaired (the same drops, injected into the items).
    assert scores["paired"][0] >= 0.95 and scores["unpaired"][0] < 0.5
    assert scores["paired"][1] <= scores["unpaired"][1]


def test_the_default_noise_aware_rule_on_our_item_curves():
    """Paired, on the reward-model item curves with every checkpoint judged, replay's default
    ``noise_aware`` rule fires on no clean curve and detects 95% of injected drops within 2
    checkpoints. Confirmation alone (no ``at_once_stderrs``, no ``final_stderrs``) detects less: a
    drop at the last checkpoint has no next result to confirm it."""
    from areal_eval.alerts import NOISE_AWARE_REGRESSION, AlertRule

    curves = read_curves(DEMO_CURVES) + read_curves(GEOMETRIC_CURVES)
    rules = [
        AlertRule("default", "regression", **NOISE_AWARE_REGRESSION),
        AlertRule(
            "confirmed", "regression", **(NOISE_AWARE_REGRESSION | {"at_once_stderrs": None, "final_stderrs": None})
        ),
    ]
    clean = replay.replay(curves, [FixedEvery(1)], alert_rules=rules)["policies"]["fixed:1"]["alerts"]
    assert clean["default"]["false_alerts_per_100_curves"] == 0
    injected = [
        replay.replay(curves, [FixedEvery(1)], regression=True, seed=seed, alert_rules=rules)["policies"]["fixed:1"]
        for seed in range(10)
    ]
    detected = {name: statistics.fmean(r["alerts"][name]["detected_within_2"] for r in injected) for name in clean}
    # Measured: 0.971 the default, 0.914 confirmed alone.
    assert detected["default"] >= 0.95 and detected["confirmed"] < detected["default"]


def test_an_injected_drop_moves_a_recorded_probe_subset_with_the_value_with_items_or_without():
    import random

    points = tuple(Point(s, 0.8, 0.02, subset=(0.75, 0.04), items=(1.0,) * 80 + (0.0,) * 20) for s in range(6))
    curve = Curve("c", True, points, subset_fraction=0.2)
    for hit, start in (replay.inject_regression(curve, random.Random(0)), replay.inject_regression(
        replay.without_items(curve), random.Random(0)
    )):  # fmt: skip
        after = hit.points[start]
        # The subset's error moves as the whole result's did (not at all without items to move).
        assert after.value < 0.8 and after.subset == pytest.approx(
            (0.75 - (0.8 - after.value), 0.04 * after.stderr / 0.02)
        )
    assert hit.points[start].stderr == 0.02 and curve.points[start].stderr == 0.02  # the last pair: without items
