import statistics

import pytest

from areal_eval.scheduling import replay
from areal_eval.scheduling.curves import Curve, Point, read_curves
from areal_eval.scheduling.policy import SchedulerConfig
from areal_eval.scheduling.probes import ProbeSettings, probe_moved, select_with_probes, subset_result
from areal_eval.scheduling.replay import parse_policy

CFG = SchedulerConfig(stderr_metric=None, max_interval_growth=None)


def flat(n=12, se=0.01, subset=None, fraction=None):
    points = tuple(Point(10 * i, 0.8, se, subset[i] if subset else None) for i in range(n))
    return Curve("flat", True, points, fraction)


def test_a_probe_moves_beyond_the_combined_noise_of_both_subset_results():
    assert not probe_moved(0.73, 0.03, 0.70, 0.04, stderrs=1.0)  # 0.03 apart, noise 0.05
    assert probe_moved(0.76, 0.03, 0.70, 0.04, stderrs=1.0)
    assert not probe_moved(0.76, 0.03, 0.70, 0.04, stderrs=2.0)


def test_simulated_subset_results_follow_the_stated_noise_model():
    # A subset of a fifth of the items: stderr sqrt(5) times the full one, and around the full
    # value with standard deviation se * sqrt(5 - 1).
    c = flat(n=4000, se=0.01)
    results = [subset_result(c, i, 0.2, "0") for i in range(len(c.points))]
    assert all(se == pytest.approx(0.01 * 5**0.5) for _, se in results)
    deviations = [v - 0.8 for v, _ in results]
    assert abs(statistics.fmean(deviations)) < 0.001
    assert statistics.stdev(deviations) == pytest.approx(0.02, rel=0.05)
    assert subset_result(c, 7, 0.2, "0") == results[7] and subset_result(c, 7, 0.2, "1") != results[7]


def test_recorded_subset_results_are_used_where_the_fraction_matches():
    c = flat(n=3, subset=[(0.5, 0.02), (0.6, 0.02), (0.7, 0.02)], fraction=0.25)
    assert subset_result(c, 1, 0.25, "0") == (0.6, 0.02)
    assert subset_result(c, 1, 0.5, "0")[0] != 0.6  # another fraction: simulated


def test_probes_run_where_the_scheduler_skips_and_escalate_on_movement():
    plain = select_with_probes(flat(), CFG, None, "0")
    never = select_with_probes(flat(), CFG, ProbeSettings(0.2, escalate_stderrs=1e9), "0")
    assert never[0] == plain[0] and plain[1] == 0
    assert never[1] == len(flat().points) - len(plain[0])  # a probe at every skipped checkpoint
    always = select_with_probes(flat(), CFG, ProbeSettings(0.2, escalate_stderrs=0.0), "0")
    assert [i for i, _ in always[0]] == list(range(12))  # every probe moved: every one escalated
    # Recorded subset results that drop at checkpoint 5: its probe escalates it to a full one.
    subset = [(0.8, 0.01)] * 5 + [(0.7, 0.01)] * 7
    evaluated, _ = select_with_probes(flat(subset=subset, fraction=0.2), CFG, ProbeSettings(0.2, 2.0), "0")
    assert 5 in [i for i, _ in evaluated] and 5 not in [i for i, _ in plain[0]]


def test_replay_counts_a_probe_as_its_fraction_of_a_full_evaluation():
    spec = "adaptive:probe_fraction=0.25,probe_escalate_stderrs=1000,max_interval_growth=null"
    row = replay.replay([flat()], [parse_policy(spec)])["policies"][spec]
    assert row["probes"] == 12 - row["evaluations"] and row["compute"] == row["evaluations"] + 0.25 * row["probes"]
    assert "probes" not in replay.replay([flat()], [parse_policy("adaptive")])["policies"]["adaptive"]


def test_bad_probe_settings_are_named():
    with pytest.raises(ValueError, match="probe_fraction"):
        parse_policy("adaptive:probe_fraction=1.5")
    with pytest.raises(ValueError, match="probe_escalate_stderrs"):
        parse_policy("adaptive:probe_escalate_stderrs=-1")


def test_our_recorded_curves_carry_subset_results_that_replay_probes_with():
    from tests.scheduling.test_replay import DEMO_CURVES, GEOMETRIC_CURVES

    for path in (DEMO_CURVES, GEOMETRIC_CURVES):
        curves = read_curves(path)
        assert all(c.subset_fraction == 0.2 and all(p.subset for p in c.points) for c in curves)
        c = curves[0]
        if c.points[3].items is None:
            assert subset_result(c, 3, 0.2, "0") == c.points[3].subset  # recorded, not drawn
        else:  # the items a probe of the pipeline scores
            from areal_eval.scheduling.probes import probe_items

            chosen = [c.points[3].items[j] for j in probe_items(len(c.points[3].items), 0.2)]
            assert subset_result(c, 3, 0.2, "0")[0] == pytest.approx(sum(chosen) / len(chosen))


def test_a_probe_is_judged_paired_on_its_items_where_both_evaluations_kept_them():
    """Five of 50 items flip up, none down: +0.1, within the two means' own errors (1.0 of 2)
    but 2.3 paired errors (the other 45 items did not move)."""
    from areal_eval.estimates import mean_and_stderr
    from areal_eval.scheduling.probes import ProbeJudge

    before = [1.0] * 25 + [0.0] * 25
    after = [1.0] * 30 + [0.0] * 20
    items = {10: before, 20: after}

    def summary(scores):
        mean, stderr = mean_and_stderr(sum(scores), sum(v * v for v in scores), len(scores))
        return {"accuracy": mean, "accuracy_stderr": stderr}

    def judge(with_items: bool):
        scores = (lambda step, metric: (dict(enumerate(items[step])), None)) if with_items else None
        judge = ProbeJudge(ProbeSettings(0.2, 2.0), "accuracy", "accuracy_stderr", 0.01, scores)
        judge.remember(10, "evaluated", summary(before))
        return judge.judge(20, summary(after))

    paired, unpaired = judge(True), judge(False)
    assert paired[0] and "2.33 > 2 stderr, paired on 50 common items" in paired[1]
    assert not unpaired[0] and "1.00 <= 2 stderr" in unpaired[1]
    # The same items, unchanged: held, whatever the errors.
    items[20] = before
    assert not judge(True)[0]
