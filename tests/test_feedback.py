"""Feedback rules on results: the same directives for the same results, whatever order they
arrived in; shadow and act; targets, plateaus, and a curve that still climbs through noise."""

import random

import pytest

from areal_eval.config.parsing import FieldError
from areal_eval.feedback import FeedbackConfig, FeedbackJudge


def results(values, stderr=0.01, every=10):
    return [(i * every, {"accuracy": v, "accuracy_stderr": stderr}) for i, v in enumerate(values)]


def judge(**cfg):
    return FeedbackJudge(FeedbackConfig(**cfg), metric="accuracy")


def test_a_plateau_scales_the_learning_rate_then_stops_and_each_directive_says_why():
    flat = results([0.5, 0.6, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7])
    said = judge(patience=3, cooldown=2, max_lr_scales=2).directives(flat)
    assert [d.id for d in said] == ["lr_scale@50", "lr_scale@80", "stop@110"]
    assert all(d.mode == "shadow" for d in said)  # the default: recorded, never applied
    first = said[0]
    assert first.steps == (20, 30, 40, 50) and first.args == {"factor": 0.5}
    assert first.reason == "accuracy flat for 3 evaluations since step 20 (+0, stderr 0.014): learning rate x0.5"
    assert first.evidence["rule"] == "plateau" and first.evidence["n_items"] is None
    acted = judge(patience=3, lr_scale="act", stop="off").directives(flat)
    assert [(d.id, d.mode) for d in acted] == [("lr_scale@50", "act"), ("lr_scale@80", "act")]
    both = judge(patience=3, lr_scale="act", stop="act", max_lr_scales=1).directives(flat)
    assert [(d.id, d.mode) for d in both] == [("lr_scale@50", "act"), ("stop@80", "act")]


def test_a_stop_that_acts_beside_a_shadow_learning_rate_rule_stops_at_the_first_plateau():
    # No cut was made, so none is waited for; the shadow record of the defaults is unchanged.
    flat = results([0.5, 0.6, 0.7] + [0.7] * 11)
    assert [(d.id, d.mode) for d in judge(patience=3, stop="act").directives(flat)] == [("stop@50", "act")]
    assert [d.id for d in judge(patience=3, stop="act", lr_scale="off").directives(flat)] == ["stop@50"]
    assert [d.id for d in judge(patience=3, lr_scale="shadow").directives(flat)][-1] == "stop@110"


def test_the_same_results_in_any_order_give_the_same_directives():
    flat = results([0.5, 0.6, 0.7, 0.7, 0.69, 0.7, 0.7, 0.71, 0.7])
    shuffled = flat[:]
    random.Random(7).shuffle(shuffled)
    assert judge().directives(flat) == judge().directives(shuffled)


def test_a_curve_still_climbing_through_noise_is_no_plateau():
    # No new best for 3 evaluations (noise), but 3 evaluations on it is 4 errors higher.
    climbing = results([0.50, 0.60, 0.58, 0.59, 0.64, 0.63, 0.64, 0.68])
    assert judge(patience=3).directives(climbing) == []


def test_a_target_reached_beyond_its_error_stops_once_and_nothing_follows():
    said = judge(target=0.8, target_stderrs=2.0, patience=None).directives(results([0.5, 0.81, 0.815, 0.85, 0.9]))
    assert [d.id for d in said] == ["stop@30"]  # 0.81 and 0.815 are within 2 errors of 0.8
    assert said[0].reason == "accuracy 0.85 is past the target 0.8 by 5.0 standard errors"
    lower = FeedbackJudge(FeedbackConfig(target=0.3, patience=None), metric="loss", higher_is_better=False)
    assert [d.id for d in lower.directives([(0, {"loss": 1.0}), (10, {"loss": 0.2})])] == ["stop@10"]


def test_paired_items_decide_a_plateau_where_the_stated_errors_would_not():
    # Two results 0.02 apart with stated errors of 0.05: unpaired, noise. On the same 400 items,
    # the later one gains 8 items and loses none: paired, a clear rise, so no plateau there.
    items = {}
    for step, gained in ((0, 0), (10, 0), (20, 0), (30, 8)):
        items[step] = {k: 1.0 if k < 200 + gained else 0.0 for k in range(400)}
    values = [(s, {"accuracy": sum(v.values()) / 400, "accuracy_stderr": 0.05}) for s, v in items.items()]
    unpaired = FeedbackJudge(FeedbackConfig(patience=3, min_delta=0.03), metric="accuracy")
    assert [d.id for d in unpaired.directives(values)] == ["lr_scale@30"]
    paired = FeedbackJudge(
        FeedbackConfig(patience=3, min_delta=0.01), metric="accuracy", items=lambda s, m: (items[s], None)
    )
    assert paired.directives(values) == []


def test_a_confirmed_regression_rolls_back_to_the_best_once_and_each_drop_is_in_the_evidence():
    # Best at step 30; one dip (40) is not a regression; two results in a row far below it (70, 80) are.
    curve = results([0.5, 0.6, 0.7, 0.8, 0.7, 0.79, 0.8, 0.6, 0.55, 0.5, 0.45, 0.4], stderr=0.01)
    said = judge(rollback="act", patience=None, max_rollbacks=1, cooldown=2).directives(curve)
    assert [d.id for d in said] == ["rollback@80"]
    back = said[0]
    assert back.mode == "act" and back.args == {"to_step": 30, "factor": 0.5} and back.steps == (30, 70, 80)
    assert back.reason == (
        "accuracy below its best level (steps 50-60) in 2 evaluations in a row (-0.245, stderr 0.012): "
        "back to the best, step 30, learning rate x0.5"
    )
    assert [d["step"] for d in back.evidence["drops"]] == [70, 80] and back.evidence["rule"] == "regression"
    assert back.evidence["level_steps"] == [50, 60]
    # A second rollback once allowed, after the cooldown; the default mode only records.
    twice = judge(patience=None, max_rollbacks=2, cooldown=2).directives(curve)
    assert [(d.id, d.mode) for d in twice] == [("rollback@80", "shadow"), ("rollback@110", "shadow")]
    assert judge(rollback="off", patience=None).directives(curve) == []


def test_a_high_result_among_dense_evaluations_is_no_level_to_fall_from():
    # One result high by its noise (0.83 at step 40) among its neighbours: the next two lie 0.04
    # below it, 2.8 errors, but within the noise of the level the run held (0.805 over 30-40).
    # Measured from the best single result (level_results 1) that was a rollback.
    dense = [0.5, 0.7, 0.80, 0.78, 0.83, 0.79, 0.79]
    assert judge(patience=None, rollback="act").directives(results(dense)) == []
    assert [d.id for d in judge(patience=None, level_results=1).directives(results(dense))] == ["rollback@60"]
    # A real drop after it: back to the best checkpoint, measured from the best level before it.
    said = judge(patience=None, rollback="act").directives(results(dense + [0.70, 0.69]))
    assert [(d.id, d.args["to_step"], d.evidence["level_steps"]) for d in said] == [("rollback@80", 40, [40, 50])]


def test_a_flat_stretch_after_a_high_result_is_a_plateau_not_a_drop():
    # The results after a noise-high best (0.83) lie 2.8 errors below it but at the level held:
    # flat, so the plateau rule stops. From the best single result they would be a drop, neither
    # rule's: a (shadow) rollback, and no stop.
    flat = results([0.5, 0.7, 0.80, 0.78, 0.83, 0.79, 0.79, 0.79])
    assert [d.id for d in judge(patience=3, stop="act").directives(flat)] == ["stop@70"]
    assert [d.id for d in judge(patience=3, stop="act", level_results=1).directives(flat)] == ["rollback@60"]


def test_the_level_is_paired_on_the_mean_of_its_items():
    # 400 items: 300 and 310 right at steps 0 and 10, then 250 and 240. Each drop is paired on the
    # items' mean over the level's two steps; the stated errors (0.5) would hide it.
    right = {0: 300, 10: 310, 20: 250, 30: 240}
    items = {s: {k: float(k < n) for k in range(400)} for s, n in right.items()}
    values = [(s, {"accuracy": n / 400, "accuracy_stderr": 0.5}) for s, n in right.items()]
    paired = FeedbackJudge(
        FeedbackConfig(patience=None, rollback="act"), metric="accuracy", items=lambda s, m: (items[s], None)
    )
    (back,) = paired.directives(values)
    assert back.id == "rollback@30" and back.evidence["level_steps"] == [0, 10]
    first = back.evidence["drops"][0]
    assert first["n_items"] == 400 and first["delta"] == pytest.approx(250 / 400 - 610 / 800)
    assert first["stderr"] < 0.05
    unpaired = FeedbackJudge(FeedbackConfig(patience=None, rollback="act"), metric="accuracy")
    assert unpaired.directives(values) == []


def test_drops_within_their_errors_are_no_regression():
    noisy = results([0.5, 0.7, 0.68, 0.67, 0.69, 0.66], stderr=0.02)  # 0.03 below, errors of 0.028 each way
    assert judge(patience=None, rollback="act").directives(noisy) == []


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("factor", 1.5, "factor"),
        ("stop", "maybe", "stop"),
        ("rollback", "yes", "rollback"),
        ("patience", 0, "patience"),
        ("factor", 0, "factor"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(field, value, named):
    with pytest.raises((FieldError, ValueError), match=named):
        FeedbackConfig(**{field: value})


def test_an_acting_rule_asks_for_the_next_checkpoint_while_it_counts_and_shadow_asks_nothing():
    # Rising: nothing to count. One result without a better one: a plateau or a regression may be
    # under way, and an acting rule wants the next checkpoint judged. After its lr_scale, the
    # cooldown's evaluations are not asked for; once it stopped, nothing is.
    rising, flat = results([0.5, 0.6, 0.7]), results([0.5, 0.6, 0.7, 0.7])
    acting = judge(stop="act", lr_scale="act", patience=3, max_lr_scales=1, cooldown=2)
    assert acting.watching(rising) is None
    assert acting.watching(flat) == "feedback: 1 evaluation(s) since the best (step 20) without a better one"
    assert judge(patience=3).watching(flat) is None  # shadow mode changes nothing, the schedule included
    scaled = results([0.5, 0.6, 0.7, 0.7, 0.7, 0.7])  # lr_scale@50
    assert [d.id for d in acting.directives(scaled)] == ["lr_scale@50"]
    assert acting.watching(scaled) is None and acting.watching(results([0.5, 0.6, 0.7] + [0.7] * 5)) is None
    recovering = results([0.5, 0.6, 0.7, 0.7, 0.7, 0.7, 0.72, 0.73, 0.73])  # past the cooldown, one not better
    assert acting.watching(recovering) == "feedback: 1 evaluation(s) since the best (step 70) without a better one"
    stopped = results([0.5, 0.6, 0.7] + [0.7] * 9)
    assert acting.directives(stopped)[-1].action == "stop" and acting.watching(stopped) is None
    # Only lr_scale acting, its scales spent: nothing left to count for.
    assert judge(lr_scale="act", max_lr_scales=1, cooldown=0).watching(results([0.5, 0.6, 0.7] + [0.7] * 5)) is None


def test_a_sharp_drop_after_a_plateau_is_no_plateau_but_a_regression_to_roll_back():
    # Flat long enough for a stop, then a result far below the best: stopping there would end
    # training on the damaged model. It is the regression rule's: two in a row, a rollback.
    flat = [0.5, 0.6, 0.7, 0.7, 0.7, 0.7]
    acting = judge(stop="act", rollback="act", max_lr_scales=0, patience=4)
    assert acting.directives(results(flat + [0.5])) == []
    said = acting.directives(results(flat + [0.5, 0.45]))
    assert [(d.id, d.args.get("to_step")) for d in said] == [("rollback@70", 20)]
    # Within its errors of the best, the same result is part of the plateau.
    assert [d.id for d in acting.directives(results(flat + [0.69]))] == ["stop@60"]
