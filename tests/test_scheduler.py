import dataclasses
from dataclasses import dataclass

import pytest

from areal_eval.scheduler import HistoryEntry, SchedulerConfig, decide


@dataclass
class Ev:
    global_step: int
    final: bool = False


def H(step, metric, se=0.01):
    return HistoryEntry(step, float(step), metric, se)


ADAPTIVE = SchedulerConfig(
    min_interval_steps=10, max_interval_steps=400, max_interval_fraction=None,
    drift_tolerance=1.0, noise_discount=1.0, regression_z=2.0,
)


def test_first_and_final_are_always_evaluated():
    assert decide(Ev(0), [], ADAPTIVE).evaluate
    plateau = [H(0, 0.8), H(100, 0.8), H(200, 0.8)]
    assert decide(Ev(205, final=True), plateau, ADAPTIVE).reason == "final checkpoint"


def test_never_twice():
    d = decide(Ev(100), [H(0, 0.5), H(100, 0.6)], ADAPTIVE)
    assert not d.evaluate and "already" in d.reason
    d = decide(Ev(50), [H(0, 0.5), H(100, 0.6)], ADAPTIVE)
    assert not d.evaluate and "older" in d.reason


def test_min_and_max_interval_bound_the_policy():
    moving = [H(0, 0.5), H(20, 0.7)]
    assert not decide(Ev(25), moving, ADAPTIVE).evaluate  # 5 < min 10
    plateau = [H(0, 0.8), H(100, 0.8)]
    assert not decide(Ev(300), plateau, ADAPTIVE).evaluate
    assert decide(Ev(500), plateau, ADAPTIVE).evaluate  # 400 >= max


def test_dense_while_moving_sparse_on_plateau():
    moving = [H(0, 0.50), H(50, 0.60)]  # 10 stderr in 50 steps
    assert decide(Ev(60), moving, ADAPTIVE).evaluate
    plateau = [H(0, 0.800), H(50, 0.805)]  # within noise
    d = decide(Ev(60), plateau, ADAPTIVE)
    assert not d.evaluate and d.reason.startswith("plateau")


def test_slow_drift_is_evaluated_once_it_adds_up():
    slow = [H(0, 0.500), H(100, 0.530)]  # 3 stderr per 100 steps, ~1.6 after the noise discount
    drift_only = dataclasses.replace(ADAPTIVE, best_drift_tolerance=None)  # the rising-best rule has its own test
    assert not decide(Ev(130), slow, drift_only).evaluate
    assert decide(Ev(190), slow, drift_only).reason.startswith("moving")


def test_regression_triggers_dense_evaluation_again():
    history = [H(0, 0.5), H(100, 0.8), H(200, 0.80), H(300, 0.74)]
    d = decide(Ev(310), history, ADAPTIVE)
    assert d.evaluate and d.reason.startswith("regression")


def test_lower_is_better_metrics():
    cfg = dataclasses.replace(ADAPTIVE, metric="loss", stderr_metric=None, higher_is_better=False, default_stderr=0.01)
    history = [H(0, 0.70, None), H(100, 0.40, None), H(200, 0.40, None), H(300, 0.46, None)]
    assert decide(Ev(310), history, cfg).reason.startswith("regression")


def test_pending_evaluations_count_for_intervals():
    history = [H(0, 0.5), H(50, 0.6), HistoryEntry(100, 100.0, None, None)]
    assert not decide(Ev(105), history, ADAPTIVE).evaluate  # 5 steps after a queued one


def test_fixed_policy():
    cfg = SchedulerConfig(policy="fixed", fixed_interval_steps=100)
    assert not decide(Ev(99), [H(0, 0.5)], cfg).evaluate
    assert decide(Ev(100), [H(0, 0.5)], cfg).evaluate
    assert decide(Ev(101, final=True), [H(0, 0.5), H(100, 0.5)], cfg).evaluate


def _evaluated_steps(checkpoint_steps, value):
    history = []
    for i, step in enumerate(checkpoint_steps):
        if decide(Ev(step, final=i == len(checkpoint_steps) - 1), history, ADAPTIVE).evaluate:
            history.append(H(step, value(step)))
    return [h.step for h in history]


def test_uneven_spacing_reasons_in_steps():
    # The same linear trend, checkpointed every 10 or every 40 steps: evaluations land about the
    # same number of *steps* apart (a count-based policy would space them 4x differently).
    def trend(step):
        return 0.5 + 0.0004 * step

    fine = _evaluated_steps(range(0, 2001, 10), trend)
    coarse = _evaluated_steps(range(0, 2001, 40), trend)
    gap = lambda steps: sorted(b - a for a, b in zip(steps, steps[1:]))[len(steps) // 2]
    assert abs(gap(fine) - gap(coarse)) <= 40, (fine, coarse)
    assert 3 < len(coarse) < 60


def test_relative_max_interval_is_scale_free():
    cfg = SchedulerConfig(max_interval_fraction=0.25, drift_tolerance=1e9)
    flat = [H(0, 0.8), H(100, 0.8)]
    assert not decide(Ev(120), flat, cfg).evaluate  # 20 < 0.25 * 120
    assert decide(Ev(140), flat, cfg).evaluate  # 40 >= 0.25 * 140
    big = [H(0, 0.8), H(100_000, 0.8)]
    assert not decide(Ev(120_000), big, cfg).evaluate and decide(Ev(140_000), big, cfg).evaluate


def test_config_validation():
    with pytest.raises(ValueError):
        SchedulerConfig(min_interval_steps=10, max_interval_steps=5)


def test_a_rising_best_is_followed_closer_than_a_moving_metric():
    # +0.012 per 100 steps, noise 0.01: too slow to count as movement after the noise discount,
    # but the latest result is the best and rising, so the next gain of 0.5 stderr is evaluated.
    rising = [H(0, 0.70), H(100, 0.712)]
    no_best_rule = dataclasses.replace(ADAPTIVE, best_drift_tolerance=None)
    assert not decide(Ev(150), rising, no_best_rule).evaluate
    assert not decide(Ev(40), rising, ADAPTIVE).evaluate  # predicted gain 0.0048 < 0.5 stderr
    d = decide(Ev(150), rising, ADAPTIVE)
    assert d.evaluate and d.reason.startswith("rising at the best")
    falling_from_best = [H(0, 0.712), H(100, 0.70)]  # the best is behind: no peak to catch
    assert not decide(Ev(150), falling_from_best, ADAPTIVE).evaluate
