import dataclasses

import pytest

from areal_eval.alerts import AlertEngine, AlertRule, AlertsConfig


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def engine(*rules, clock=None):
    return AlertEngine(AlertsConfig(rules=list(rules)), clock=clock or Clock())


def test_threshold():
    e = engine(AlertRule("low-acc", "threshold", metric="accuracy", op="<", value=0.6))
    assert e.check(1, {"accuracy": 0.7}) == []
    [alert] = e.check(2, {"accuracy": 0.55})
    assert alert.rule == "low-acc" and "0.55 < 0.6" in alert.message and not alert.throttled


def test_regression_from_best():
    e = engine(AlertRule("reg", "regression", metric="accuracy", tolerance=0.05))
    assert e.check(1, {"accuracy": 0.7}) == []
    assert e.check(2, {"accuracy": 0.8}) == []
    assert e.check(3, {"accuracy": 0.76}) == []
    [alert] = e.check(4, {"accuracy": 0.7})
    assert "worse than the best 0.8" in alert.message


def test_nonfinite_and_failure():
    e = engine(AlertRule("nan", "nonfinite", stop_training=True), AlertRule("fail", "eval_failed"))
    [alert] = e.check(1, {"accuracy": float("nan"), "loss": 0.3})
    assert alert.rule == "nan" and alert.stop_training and "accuracy" in alert.message
    [alert] = e.check(2, None, error="CheckpointError: x")
    assert alert.rule == "fail" and "CheckpointError" in alert.message


def test_min_step_ignores_the_baseline():
    e = engine(AlertRule("low", "threshold", value=0.6, min_step=1))
    assert e.check(0, {"accuracy": 0.5}) == []
    assert len(e.check(10, {"accuracy": 0.5})) == 1


def test_repeated_alerts_are_throttled():
    clock = Clock()
    e = engine(AlertRule("low", "threshold", value=0.6, throttle_secs=60), clock=clock)
    first = e.check(1, {"accuracy": 0.5})[0]
    clock.now = 30
    second = e.check(2, {"accuracy": 0.5})[0]
    clock.now = 61
    third = e.check(3, {"accuracy": 0.5})[0]
    assert (first.throttled, second.throttled, third.throttled) == (False, True, False)


def test_duplicate_rule_names_rejected():
    with pytest.raises(ValueError, match="duplicate"):
        AlertsConfig(rules=[AlertRule("a", "nonfinite"), AlertRule("a", "eval_failed")])


def test_a_noise_aware_regression_fires_past_k_combined_standard_errors():
    e = engine(AlertRule("reg", "regression", stderrs=2.0, throttle_secs=0))
    assert e.check(1, {"accuracy": 0.80, "accuracy_stderr": 0.01}) == []
    assert e.check(2, {"accuracy": 0.78, "accuracy_stderr": 0.01}) == []  # 0.02 / 0.0141: 1.4 se
    [alert] = e.check(3, {"accuracy": 0.77, "accuracy_stderr": 0.01})  # 0.03 / 0.0141: 2.1 se
    assert "worse than the best 0.8" in alert.message and "2.1 standard errors" in alert.message
    # Without a standard error the noise is unknown: a breach fires.
    unknown = engine(AlertRule("r", "regression", stderrs=2.0))
    assert unknown.check(1, {"accuracy": 0.80}) == [] and len(unknown.check(2, {"accuracy": 0.79})) == 1


def test_a_noise_aware_rule_fires_on_a_run_of_small_breaches():
    e = engine(AlertRule("reg", "regression", stderrs=3.0, consecutive=3, throttle_secs=0))
    results = [0.80, 0.79, 0.80, 0.79, 0.79, 0.79]  # each 0.7 se below the best
    fired = [bool(e.check(step, {"accuracy": v, "accuracy_stderr": 0.01})) for step, v in enumerate(results)]
    assert fired == [False, False, False, False, False, True]
    low = engine(AlertRule("low", "threshold", value=0.5, consecutive=2, stderr_metric="{metric}_se"))
    assert [bool(low.check(s, {"accuracy": v})) for s, v in enumerate([0.4, 0.6, 0.45, 0.48])] == [
        False,
        False,
        False,
        True,
    ]


def test_a_noise_aware_threshold_needs_distance_from_its_value():
    e = engine(AlertRule("low", "threshold", value=0.6, stderrs=2.0, throttle_secs=0))
    assert e.check(1, {"accuracy": 0.59, "accuracy_stderr": 0.01}) == []
    [alert] = e.check(2, {"accuracy": 0.57, "accuracy_stderr": 0.01})
    assert "3.0 standard errors" in alert.message


def test_a_regression_can_be_measured_from_the_mean_of_recent_results():
    rule = AlertRule("reg", "regression", stderrs=2.0, baseline_results=2, throttle_secs=0)
    e = engine(rule)
    for step, value in enumerate([0.70, 0.86, 0.80, 0.82]):  # a lucky 0.86 among them
        assert e.check(step, {"accuracy": value, "accuracy_stderr": 0.02}) == []
    # 0.79 is 0.07 below the best (2.5 combined errors) but 0.02 below the mean of the last two
    # (0.81, its error 0.02 / sqrt(2)): 0.8 combined errors, no alert.
    assert e.check(4, {"accuracy": 0.79, "accuracy_stderr": 0.02}) == []
    best = engine(AlertRule("best", "regression", stderrs=2.0))
    for step, value in enumerate([0.70, 0.86, 0.80, 0.82]):
        best.check(step, {"accuracy": value, "accuracy_stderr": 0.02})
    assert best.check(4, {"accuracy": 0.79, "accuracy_stderr": 0.02})
    # Measured from the recent mean, a real drop fires: 0.74 is 0.065 below 0.805 (2.7 errors).
    [alert] = e.check(5, {"accuracy": 0.74, "accuracy_stderr": 0.02})
    assert "worse than the mean of the 2 results 0.805 before it" in alert.message
    # The recent results are those of earlier steps, whatever order results arrive in.
    late = engine(rule)
    for step, value in [(0, 0.80), (2, 0.80), (3, 0.74), (1, 0.80)]:
        late.check(step, {"accuracy": value, "accuracy_stderr": 0.02})
    assert late._baseline(rule, 3)[0] == pytest.approx(0.80)


def test_baseline_results_must_be_positive():
    with pytest.raises(ValueError, match="baseline_results"):
        AlertRule("reg", "regression", baseline_results=0)
    with pytest.raises(ValueError, match="baseline_results: is for regression rules, not threshold"):
        AlertRule("low", "threshold", baseline_results=3)


def _item_steps():
    """400 items scored 0/1 at three steps: step 2 is step 1 with 8 items gained and 8 lost
    (no change), step 3 is step 1 with 22 items lost (a regression the two errors hide)."""
    import random

    from areal_eval.estimates import mean_and_stderr

    rng = random.Random(0)
    base = [float(rng.random() < 0.7) for _ in range(400)]
    right, wrong = [j for j, v in enumerate(base) if v], [j for j, v in enumerate(base) if not v]
    noisy, worse = list(base), list(base)
    for j in right[:8]:
        noisy[j] = 0.0
    for j in wrong[:8]:
        noisy[j] = 1.0
    for j in right[8:30]:
        worse[j] = 0.0
    steps = {1: base, 2: noisy, 3: worse}
    metrics = {}
    for step, scores in steps.items():
        mean, stderr = mean_and_stderr(sum(scores), sum(scores), len(scores))
        metrics[step] = {"accuracy": mean, "accuracy_stderr": stderr}
    return steps, metrics


def test_a_regression_on_the_same_items_is_judged_by_the_paired_error_of_their_differences():
    steps, metrics = _item_steps()
    rule = AlertRule("reg", "regression", metric="accuracy", stderrs=3.0)

    def items(step, metric):
        return ({j: v for j, v in enumerate(steps[step])}, None) if metric == "accuracy" else None

    unpaired, paired = engine(rule), AlertEngine(AlertsConfig(rules=[rule]), clock=Clock(), items=items)
    for e in (unpaired, paired):
        assert e.check(1, metrics[1]) == [] and e.check(2, metrics[2]) == []  # no change: silent
    drop = metrics[1]["accuracy"] - metrics[3]["accuracy"]
    combined = (metrics[1]["accuracy_stderr"] ** 2 + metrics[3]["accuracy_stderr"] ** 2) ** 0.5
    assert drop / combined < 2  # the two results' own errors hide the drop ...
    assert unpaired.check(3, metrics[3]) == []
    [alert] = paired.check(3, metrics[3])  # ... their paired error does not (against step 2, the best)
    assert "paired on 400 items" in alert.message and "standard errors" in alert.message


def test_where_a_step_kept_no_items_the_rule_falls_back_to_the_unpaired_errors():
    steps, metrics = _item_steps()
    rule = AlertRule("reg", "regression", metric="accuracy", stderrs=3.0)
    e = AlertEngine(AlertsConfig(rules=[rule]), clock=Clock(), items=lambda step, metric: None)
    assert e.check(1, metrics[1]) == [] and e.check(3, metrics[3]) == []
    big = {"accuracy": metrics[1]["accuracy"] - 0.2, "accuracy_stderr": metrics[1]["accuracy_stderr"]}
    [alert] = e.check(4, big)
    assert "paired" not in alert.message


def test_a_confirmed_rule_fires_on_a_lasting_drop_not_on_a_spike_that_recovers():
    rule = AlertRule("reg", "regression", stderrs=3.0, baseline_results=2, confirm=2, throttle_secs=0)
    e = engine(rule)
    for step, value in ((1, 0.80), (2, 0.80), (3, 0.60), (4, 0.80), (5, 0.80)):
        assert e.check(step, {"accuracy": value, "accuracy_stderr": 0.01}) == []  # 3: a spike, gone at 4
    assert e.check(6, {"accuracy": 0.60, "accuracy_stderr": 0.01}) == []  # the drop's first result
    [alert] = e.check(7, {"accuracy": 0.61, "accuracy_stderr": 0.01})  # confirmed by the next
    assert "2 evaluations in a row" in alert.message
    # A result in between that does not breach by stderrs breaks the run.
    e = engine(rule)
    for step, value in ((1, 0.80), (2, 0.80), (3, 0.60), (4, 0.795), (5, 0.60)):
        assert e.check(step, {"accuracy": value, "accuracy_stderr": 0.01}) == []


def test_a_confirming_result_is_measured_from_the_baseline_before_the_drop():
    # Against the mean of the 3 results before it, 0.70 at step 5 is 0.70 vs 0.733 (the drop at
    # step 4 is in that mean): under 3 standard errors. From the level before the drop, 0.80, it
    # is 8.7 (step 4's is 17).
    rule = AlertRule("reg", "regression", stderrs=3.0, baseline_results=3, confirm=2, throttle_secs=0)
    e = engine(rule)
    for step, value in ((1, 0.80), (2, 0.80), (3, 0.80), (4, 0.60)):
        assert e.check(step, {"accuracy": value, "accuracy_stderr": 0.01}) == []
    [alert] = e.check(5, {"accuracy": 0.70, "accuracy_stderr": 0.01})
    assert "mean of the 3 results 0.8" in alert.message and "2 evaluations in a row" in alert.message


def test_confirm_needs_stderrs():
    from areal_eval.config.parsing import FieldError

    with pytest.raises(FieldError, match="confirm"):
        AlertRule("reg", "regression", confirm=2)


def test_a_confirmed_rule_fires_at_once_on_a_breach_of_at_once_stderrs():
    rule = AlertRule(
        "reg", "regression", stderrs=2.0, baseline_results=3, confirm=2, at_once_stderrs=5.0, throttle_secs=0
    )
    e = engine(rule)
    for step in (1, 2, 3):
        assert e.check(step, {"accuracy": 0.80, "accuracy_stderr": 0.01}) == []
    assert e.check(4, {"accuracy": 0.765, "accuracy_stderr": 0.01}) == []  # 2.5 combined errors: waits
    [alert] = e.check(5, {"accuracy": 0.70, "accuracy_stderr": 0.01})  # 9 from the level before step 4
    assert "2 evaluations in a row" in alert.message
    e = engine(rule)
    for step in (1, 2, 3):
        assert e.check(step, {"accuracy": 0.80, "accuracy_stderr": 0.01}) == []
    [alert] = e.check(4, {"accuracy": 0.70, "accuracy_stderr": 0.01})  # 8.7: no waiting
    assert "unconfirmed" in alert.message


def test_at_the_final_checkpoint_a_breach_of_final_stderrs_fires_unconfirmed():
    rule = AlertRule("reg", "regression", stderrs=2.0, baseline_results=3, confirm=2, final_stderrs=3.5)
    for final, fired in ((False, False), (True, True)):
        e = engine(dataclasses.replace(rule, throttle_secs=0))
        for step in (1, 2, 3):
            assert e.check(step, {"accuracy": 0.80, "accuracy_stderr": 0.01}) == []
        alerts = e.check(4, {"accuracy": 0.755, "accuracy_stderr": 0.01}, final=final)  # 3.9 from the level
        assert bool(alerts) == fired  # at the final checkpoint no result will come: it does not wait for one
    assert "at the final checkpoint, unconfirmed" in alerts[0].message


@pytest.mark.parametrize("field", ["at_once_stderrs", "final_stderrs"])
def test_unconfirmed_breaches_need_confirm(field):
    from areal_eval.config.parsing import FieldError

    with pytest.raises(FieldError, match=field):
        AlertRule("reg", "regression", stderrs=3.0, **{field: 5.0})


@pytest.mark.parametrize("tie", [False, True], ids=["0/1 scores: McNemar", "a tie: the guarded error"])
def test_a_paired_rule_does_not_fire_on_a_handful_of_items_lost(tie):
    # 4 of 400 items lost at two steps in a row, none gained: the plain paired error calls each
    # 2 standard errors, yet McNemar's p is 0.125. Where every score is 0 or 1 the rule measures
    # by McNemar's exact test; with a tie (a score of 0.5) in the guarded error.
    last = [0.5] if tie else [1.0]
    scores = {1: [1.0] * 399 + last, 2: [1.0] * 399 + last, 3: [1.0] * 399 + last}
    scores[4] = scores[5] = [0.0] * 4 + [1.0] * 395 + last

    def items(step, metric):
        return ({j: v for j, v in enumerate(scores[step])}, None)

    rule = AlertRule("reg", "regression", stderrs=2.0, baseline_results=3, confirm=2, throttle_secs=0)
    e = AlertEngine(AlertsConfig(rules=[rule]), clock=Clock(), items=items)
    for step, values in scores.items():
        mean = sum(values) / 400
        assert e.check(step, {"accuracy": mean, "accuracy_stderr": (mean * (1 - mean) / 400) ** 0.5}) == []
    scores[6] = scores[7] = [0.0] * 30 + [1.0] * 369 + last  # 30 lost twice: a drop, confirmed
    lower = {"accuracy": 370 / 400, "accuracy_stderr": (370 * 30 / 400**3) ** 0.5}
    assert e.check(6, lower) == []
    [alert] = e.check(7, lower)
    assert "paired on 400 items" in alert.message


def test_a_drop_from_100_percent_is_seen_at_once_by_the_exact_test():
    # 24 of 400 lost from 100%: 5.05 plain paired errors, 4.95 guarded ones, 5.3 by McNemar's
    # exact test, which is the one that holds for 0/1 scores.
    scores = {1: [1.0] * 400, 2: [1.0] * 400, 3: [1.0] * 400, 4: [0.0] * 24 + [1.0] * 376}

    def items(step, metric):
        return ({j: v for j, v in enumerate(scores[step])}, None)

    rule = AlertRule("reg", "regression", stderrs=2.0, baseline_results=3, confirm=2, at_once_stderrs=5.0)
    e = AlertEngine(AlertsConfig(rules=[rule]), clock=Clock(), items=items)
    for step in (1, 2, 3):
        assert e.check(step, {"accuracy": 1.0, "accuracy_stderr": 0.0}) == []
    [alert] = e.check(4, {"accuracy": 0.94, "accuracy_stderr": (0.94 * 0.06 / 400) ** 0.5})
    assert "unconfirmed" in alert.message and "paired on 400 items" in alert.message


def test_a_run_is_confirmed_whatever_order_its_results_arrive_in():
    # Step 5 finishes before step 4 (two slots): when 4 arrives, 4 and 5 are a run of two drops.
    rule = AlertRule("reg", "regression", stderrs=3.0, baseline_results=3, confirm=2, throttle_secs=0)
    e = engine(rule)
    for step in (1, 2, 3):
        assert e.check(step, {"accuracy": 0.80, "accuracy_stderr": 0.01}) == []
    assert e.check(5, {"accuracy": 0.60, "accuracy_stderr": 0.01}) == []  # 3 and 5 in a row: 3 is no drop
    [alert] = e.check(4, {"accuracy": 0.61, "accuracy_stderr": 0.01})
    assert "at step 5" in alert.message and "2 evaluations in a row" in alert.message
    # A later result that does not breach leaves the earlier one unconfirmed.
    e = engine(rule)
    for step, value in ((1, 0.80), (2, 0.80), (3, 0.80), (5, 0.80)):
        assert e.check(step, {"accuracy": value, "accuracy_stderr": 0.01}) == []
    assert e.check(4, {"accuracy": 0.60, "accuracy_stderr": 0.01}) == []
