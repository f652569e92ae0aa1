import dataclasses
from dataclasses import dataclass

import pytest

from areal_eval.scheduling.policy import (
    HistoryEntry,
    SchedulerConfig,
    decide,
    look_back,
    refine,
)


@dataclass
class Ev:
    global_step: int
    final: bool = False


def H(step, metric, se=0.01):
    return HistoryEntry(step, float(step), metric, se)


ADAPTIVE = SchedulerConfig(
    min_interval_steps=10,
    max_interval_steps=400,
    max_interval_checkpoints=None,
    max_interval_growth=None,
    drift_tolerance=1.0,
    noise_discount=1.0,
    regression_z=2.0,
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


def test_a_training_metric_that_jumps_on_a_flat_evaluation_curve_gets_the_checkpoint_evaluated():
    plateau = [H(0, 0.800), H(50, 0.805)]
    calm = [(s, 0.30 + 0.01 * (-1) ** (s // 10)) for s in range(0, 70, 10)]  # changes of 0.02 a checkpoint
    falling = [(s, 0.60 - 0.03 * s / 10) for s in range(0, 70, 10)]  # a steady trend is no jump
    spiked = calm[:-1] + [(60, 0.60)]  # a collapse at step 60: the loss doubles
    with_train = dataclasses.replace(ADAPTIVE, train_metric="loss")
    assert not decide(Ev(60), plateau, with_train, train=calm).evaluate
    assert not decide(Ev(60), plateau, with_train, train=falling).evaluate
    moved = decide(Ev(60), plateau, with_train, train=spiked)
    assert moved.evaluate and moved.reason == "training moved: loss 0.29 -> 0.6 (15.5x its typical change)"
    assert not decide(Ev(60), plateau, ADAPTIVE, train=spiked).evaluate  # off unless train_metric is set
    assert not decide(Ev(60), plateau, with_train, train=spiked[-3:]).evaluate  # too few to know its typical change
    assert not decide(Ev(60), plateau, with_train, train=spiked[:-1]).evaluate  # no value at this checkpoint


def test_slow_drift_is_evaluated_once_it_adds_up():
    slow = [H(0, 0.500), H(100, 0.530)]  # 3 stderr per 100 steps, ~1.6 after the noise discount
    assert not decide(Ev(130), slow, ADAPTIVE).evaluate
    assert decide(Ev(190), slow, ADAPTIVE).reason.startswith("moving")


def test_movement_and_regressions_are_judged_paired_where_both_results_kept_items():
    """0.800 to 0.815 is within the two results' own errors combined (0.014 each), but on the
    same items their difference has a paired error of 0.003: the metric moves."""
    plateau = [H(0, 0.800, se=0.014), H(50, 0.815, se=0.014)]
    assert decide(Ev(110), plateau, ADAPTIVE).reason.startswith("plateau")
    paired = {(50, 0): 0.003}
    d = decide(Ev(110), plateau, ADAPTIVE, paired=lambda a, b: paired.get((a, b)))
    assert d.reason.startswith("moving")
    assert decide(Ev(110), plateau, ADAPTIVE, paired=lambda a, b: None).reason.startswith("plateau")  # no items
    dip = [H(0, 0.5, se=0.014), H(100, 0.80, se=0.014), H(200, 0.775, se=0.014)]
    assert not decide(Ev(210), dip, ADAPTIVE).reason.startswith("regression")  # 0.025 < 2 x 0.0198
    d = decide(Ev(210), dip, ADAPTIVE, paired=lambda a, b: 0.004 if (a, b) == (200, 100) else None)
    assert d.reason.startswith("regression")


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


def _evaluated_steps(checkpoint_steps, value, cfg=ADAPTIVE):
    history = []
    for i, step in enumerate(checkpoint_steps):
        event = Ev(step, final=i == len(checkpoint_steps) - 1)
        if decide(event, history, cfg, checkpoint_steps[:i]).evaluate:
            history.append(H(step, value(step)))
    return [h.step for h in history]


def test_uneven_spacing_reasons_in_steps():
    # The same linear trend, checkpointed every 10 or every 40 steps: evaluations land about the
    # same number of *steps* apart (a count-based policy would space them 4x differently).
    def trend(step):
        return 0.5 + 0.0004 * step

    fine = _evaluated_steps(range(0, 2001, 10), trend)
    coarse = _evaluated_steps(range(0, 2001, 40), trend)

    def gap(steps):
        return sorted(b - a for a, b in zip(steps, steps[1:], strict=False))[len(steps) // 2]

    assert abs(gap(fine) - gap(coarse)) <= 40, (fine, coarse)
    assert 3 < len(coarse) < 60


def test_cover_bound_counts_checkpoints_whatever_their_spacing():
    cfg = SchedulerConfig(max_interval_checkpoints=3, max_interval_growth=None, drift_tolerance=1e9)
    even = [0, 100, 200, 300, 400, 500]
    geometric = [0, 1, 2, 4, 8, 16, 32]
    bursty = [0, 1000, 1001, 1002, 5000, 9000]
    for steps in (even, geometric, bursty):
        flat = [H(s, 0.8) for s in steps[:3]]
        assert not decide(Ev(steps[4]), flat, cfg, steps[:4]).evaluate  # the 2nd since the last
        d = decide(Ev(steps[5]), flat, cfg, steps[:5])
        assert d.evaluate and d.reason == f"checkpoint 3 since step {steps[2]} (max_interval_checkpoints)"
    # a resumed run's gap in steps is one checkpoint like any other
    assert not decide(Ev(90_000), [H(0, 0.8), H(10, 0.8), H(20, 0.8)], cfg, [0, 10, 20]).evaluate
    # checkpoints offered before the last evaluation do not count
    assert not decide(Ev(40), [H(0, 0.8), H(10, 0.8), H(30, 0.8)], cfg, [0, 10, 20, 30]).evaluate


def test_the_cover_bound_never_forces_every_checkpoint_of_a_geometric_schedule():
    cfg = SchedulerConfig(drift_tolerance=1e9, refine_stderrs=None, max_interval_growth=None)
    steps = [0] + [2**i for i in range(16)]
    evaluated = _evaluated_steps(steps, lambda step: 0.8, cfg)
    assert evaluated == [0, 1, 8, 64, 512, 4096, 32768]  # first, trend, every 3rd, final


def test_growth_bound_evaluates_once_training_grew_by_the_fraction_whatever_the_spacing():
    cfg = SchedulerConfig(drift_tolerance=1e9, refine_stderrs=None, max_interval_checkpoints=None)
    assert cfg.max_interval_growth == 0.5
    flat = [H(0, 0.8), H(100, 0.8), H(1000, 0.8)]
    assert not decide(Ev(1499), flat, cfg).evaluate
    d = decide(Ev(1500), flat, cfg)
    assert d.evaluate and d.reason == "500 steps since step 1000 >= max_interval_growth 0.5x"
    # early, on a doubling schedule: every checkpoint; later, on an even one: ever sparser
    assert _evaluated_steps([0, 1, 2, 4, 8, 16, 32], lambda step: 0.8, cfg) == [0, 1, 2, 4, 8, 16, 32]
    late = _evaluated_steps(range(1000, 10001, 100), lambda step: 0.8, cfg)
    assert late == [1000, 1100, 1700, 2600, 3900, 5900, 8900, 10000]


def test_config_validation():
    with pytest.raises(ValueError):
        SchedulerConfig(min_interval_steps=10, max_interval_steps=5)


def test_refine_looks_at_skipped_neighbours_of_the_best():
    cfg = SchedulerConfig(refine_stderrs=2.0)
    history = [H(0, 0.50), H(30, 0.80), H(60, 0.70), H(90, 0.79)]
    # 40 lies between 30 (best) and 60: interpolated 0.767, 3.3 stderr below the best: no.
    # 20 lies between 0 and 30: interpolated 0.70: no. 70 is next to 60, not to the best: no.
    assert refine(history, [10, 20, 40, 50, 70], cfg) == []
    close = [H(0, 0.50), H(30, 0.80), H(60, 0.79), H(90, 0.70)]
    assert [s for s, _ in refine(close, [20, 40, 50, 70], cfg)] == [40]  # 0.797 is within 2 stderr
    assert refine(close, [20, 40, 50, 70], cfg)[0][1].startswith("refine: next to the best (step 30)")
    at_the_end = [H(0, 0.5), H(30, 0.6), H(60, 0.8)]
    # 50: interpolated 0.733, no; 70: nothing evaluated beyond, so the best's own value: yes.
    assert [s for s, _ in refine(at_the_end, [50, 70], cfg)] == [70]
    # 40 deleted by retention: not evaluated, and 50 beyond it is still not next to the best
    assert refine(close, [20, 40, 50, 70], cfg, deleted_steps={40}) == []
    assert refine(close, [40], dataclasses.replace(cfg, refine_stderrs=None)) == []
    assert refine(close, [40], dataclasses.replace(cfg, policy="fixed")) == []


def test_refine_in_the_metric_direction():
    cfg = SchedulerConfig(refine_stderrs=1.0, higher_is_better=False, stderr_metric=None)
    loss = [H(0, 0.70, None), H(30, 0.40, None), H(60, 0.41, None)]
    assert [s for s, _ in refine(loss, [20, 40], cfg)] == [40]  # 0.403 within 1 stderr of 0.40; 20: 0.50


def test_a_result_two_errors_below_the_best_gets_the_next_checkpoint_evaluated():
    """By default a suspected regression is 2 errors of the difference below the best: the line
    the default alert rule confirms at, so its confirming result is the next checkpoint."""
    cfg = SchedulerConfig(min_interval_steps=0, max_interval_checkpoints=None, max_interval_growth=None)
    history = [H(0, 0.8), H(100, 0.8), H(200, 0.765)]  # 0.035 below: 2.5 combined errors
    assert decide(Ev(210), history, cfg).reason.startswith("regression")
    assert decide(Ev(210), history, dataclasses.replace(cfg, regression_z=3.0)).reason.startswith("plateau")


def test_look_back_at_the_checkpoints_skipped_before_a_fresh_suspected_regression():
    cfg = SchedulerConfig()
    # 60 lies 4.2 errors of the difference below the best (step 0); 30 was level with it.
    history = [H(0, 0.80), H(30, 0.80), H(60, 0.74)]
    [(newest, reason), (older, _)] = look_back(history, 60, [10, 20, 40, 50], cfg)
    assert (newest, older) == (50, 40) and reason == "look back: step 60 is 0.06 below best at step 0 (> 2.0 stderr)"
    assert [s for s, _ in look_back(history, 60, [10, 20, 40, 50], dataclasses.replace(cfg, look_back=1))] == [50]
    assert [s for s, _ in look_back(history, 60, [10, 20, 40, 50], cfg, deleted_steps={50})] == [40]
    assert look_back(history + [H(90, None)], 60, [40, 50], cfg) != []  # a newer one still pending
    assert look_back(history, 30, [10, 20], cfg) == []  # not the newest result: a look-back's own
    assert look_back(history, 60, [10, 20], cfg) == []  # nothing skipped since the result before
    assert look_back([H(0, 0.80), H(30, 0.74), H(60, 0.74)], 60, [40, 50], cfg) == []  # not fresh
    assert look_back([H(0, 0.80), H(30, 0.80), H(60, 0.78)], 60, [40, 50], cfg) == []  # within its noise
    loss = SchedulerConfig(higher_is_better=False)
    assert [s for s, _ in look_back([H(0, 0.5), H(30, 0.5), H(60, 0.56)], 60, [40, 50], loss)] == [50, 40]
    assert look_back(history, 60, [40, 50], dataclasses.replace(cfg, look_back=0)) == []
    assert look_back(history, 60, [40, 50], dataclasses.replace(cfg, policy="fixed")) == []


def test_look_back_judges_by_the_paired_error_where_both_results_kept_items():
    history = [H(0, 0.80, 0.02), H(30, 0.80, 0.02), H(60, 0.76, 0.02)]  # 1.4 errors combined: no
    assert look_back(history, 60, [40, 50], SchedulerConfig()) == []

    def paired(a, b):  # on the same items their difference has 0.01 of noise, not 0.028: 4 errors
        return 0.01

    assert [s for s, _ in look_back(history, 60, [40, 50], SchedulerConfig(), paired=paired)] == [50, 40]
