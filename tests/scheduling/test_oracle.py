import itertools
import random

import pytest

from areal_eval.scheduling import replay
from areal_eval.scheduling.curves import Curve, Point
from areal_eval.scheduling.oracle import delay_bounded_compute, least_tracking_errors, oracle_compute
from areal_eval.scheduling.replay import FixedEvery, parse_policy


def random_curve(rng: random.Random, n: int, name: str = "c") -> Curve:
    # Odd inputs on purpose: repeated values, a stderr spanning orders of magnitude, one point.
    values = [rng.choice([0.5, rng.random()]) for _ in range(n)]
    points = tuple(Point(3 * i + 1, v, 10 ** rng.uniform(-3, 0)) for i, v in enumerate(values))
    return Curve(name, rng.random() < 0.5, points)


def test_least_errors_equal_brute_force_over_every_choice_of_checkpoints():
    rng = random.Random(7)
    for _ in range(150):
        c = random_curve(rng, rng.randint(1, 8))
        n = len(c.points)
        errors = least_tracking_errors(c)
        assert errors[0] == float("inf")
        for b in range(1, n + 1):
            brute = min(
                replay.score(c, [0, *rest])["tracking_error"] * n for rest in itertools.combinations(range(1, n), b - 1)
            )
            assert errors[b] == pytest.approx(brute, abs=1e-9)


def test_no_policy_spends_less_than_the_oracle_at_its_tracking_error():
    rng = random.Random(3)
    curves = [random_curve(rng, rng.randint(1, 30), name=str(i)) for i in range(12)]
    policies = [FixedEvery(k) for k in (1, 2, 3, 5)] + [parse_policy("adaptive")]
    for row in replay.replay(curves, policies, regression=True, seed=1)["policies"].values():
        replayed = [replay.inject_regression(c, random.Random(f"1:{c.name}"))[0] for c in curves]
        assert oracle_compute(replayed, row["mean_tracking_error"]) <= row["compute"] + 1e-9


def test_the_oracle_spans_one_evaluation_per_curve_to_every_checkpoint():
    curves = [Curve("a", True, tuple(Point(i, v, 0.1) for i, v in enumerate([0.1, 0.5, 0.2, 0.9])))]
    assert oracle_compute(curves, 1e9) == 1  # the first checkpoint, which every policy evaluates
    assert oracle_compute(curves, 0.0) == 4  # distinct values: all of them
    # By hand: 2 evaluations at best {0, 3} (errors 0, 4, 1, 0: mean 1.25); 3 at best {0, 1, 3}
    # (errors 0, 0, 3, 0: mean 0.75). 3 lies above the line from 2 to 4 (mean 0), so the bound
    # follows that line: 2 + 0.25 / 0.625 evaluations for a mean of 1.
    errors = least_tracking_errors(curves[0])
    assert errors[1:] == pytest.approx([4 + 1 + 8, 5, 3, 0])
    assert oracle_compute(curves, 1.0) == pytest.approx(2.4)


def _delay(curve: Curve, chosen: list[int]) -> float:
    """Replay's detection delay for ``chosen``, averaged over every start it may draw."""
    n = len(curve.points)
    starts = range(n // 2, n)
    return sum(min([i for i in chosen if i >= s] + [n - 1]) - s for s in starts) / len(starts)


def test_the_delay_bound_lies_under_every_schedule_that_meets_both_scores():
    rng = random.Random(11)
    for trial in range(40):
        curves = [random_curve(rng, rng.randint(2, 7), name=f"{trial}.{i}") for i in range(rng.randint(1, 2))]
        schedules = []  # every choice of checkpoints on every curve: (compute, mean error, mean delay)
        per_curve = [
            [
                (len(chosen), replay.score(c, chosen)["tracking_error"], _delay(c, chosen))
                for b in range(len(c.points))
                for rest in itertools.combinations(range(1, len(c.points)), b)
                for chosen in [[0, *rest]]
            ]
            for c in curves
        ]
        for combo in itertools.product(*per_curve):
            schedules.append(
                (sum(x[0] for x in combo), sum(x[1] for x in combo) / len(combo), sum(x[2] for x in combo) / len(combo))
            )
        for error, delay in [(rng.uniform(0, 3), rng.uniform(0, 2)) for _ in range(5)]:
            feasible = [compute for compute, e, d in schedules if e <= error and d <= delay]
            if feasible:
                assert delay_bounded_compute(curves, error, delay) <= min(feasible) + 1e-9


def test_the_delay_bound_meets_the_oracle_without_a_delay_and_rises_with_one():
    rng = random.Random(5)
    curves = [random_curve(rng, 20, name=str(i)) for i in range(6)]
    error = replay.replay(curves, [parse_policy("fixed:3")])["policies"]["fixed:3"]["mean_tracking_error"]
    assert delay_bounded_compute(curves, error, 1e9) == pytest.approx(oracle_compute(curves, error), rel=0.02)
    assert delay_bounded_compute(curves, error, 0.0) >= sum(len(c.points) - len(c.points) // 2 for c in curves)
