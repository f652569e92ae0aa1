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
