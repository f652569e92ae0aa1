"""Paired statistics against independent computations (numpy, scipy) on odd inputs."""

import math
import random

import numpy as np
import pytest

from areal_eval.paired import NoCommonItems, mcnemar_exact, mean_scores, paired_difference


@pytest.fixture(scope="module")
def stats():
    """``scipy.stats``, imported by the tests that compare with it, not by every lane's collection."""
    from scipy import stats

    return stats


def correlated(n: int, seed: int, lift: float = 0.0):
    """Item difficulties shared by two evaluations: scores that move together."""
    rng = random.Random(seed)
    hard = [rng.random() for _ in range(n)]
    a = {i: float(rng.random() > h) for i, h in enumerate(hard)}
    b = {i: float(rng.random() > h - lift) for i, h in enumerate(hard)}
    return a, b


def test_the_paired_error_and_interval_are_the_sample_error_of_the_differences(stats):
    a, b = correlated(57, 0, lift=0.1)
    got = paired_difference(a, b)
    d = np.array([b[i] - a[i] for i in range(57)])
    assert got.n == 57 and got.difference == pytest.approx(d.mean(), abs=1e-12)
    assert got.stderr == pytest.approx(d.std(ddof=1) / math.sqrt(57), rel=1e-12)
    low, high = stats.norm.interval(0.95, loc=d.mean(), scale=got.stderr)
    assert (got.ci_low, got.ci_high) == pytest.approx((low, high), rel=1e-9)
    xs, ys = np.array(list(a.values())), np.array(list(b.values()))
    unpaired = math.hypot(xs.std(ddof=1) / math.sqrt(57), ys.std(ddof=1) / math.sqrt(57))
    assert got.unpaired_stderr == pytest.approx(unpaired, rel=1e-12)
    assert got.stderr < got.unpaired_stderr  # shared difficulty: pairing sees more


def test_mcnemar_is_the_exact_binomial_test_of_the_discordant_items(stats):
    for up, down in [(0, 0), (1, 0), (9, 1), (30, 12), (7, 7), (400, 350)]:
        a = [0.0] * up + [1.0] * down + [1.0] * 5
        b = [1.0] * up + [0.0] * down + [1.0] * 5
        expected = 1.0 if up + down == 0 else stats.binomtest(up, up + down, 0.5).pvalue
        assert mcnemar_exact(a, b) == pytest.approx(expected, rel=1e-9), (up, down)
    assert paired_difference({0: 0.5}, {0: 1.0}).mcnemar_p is None  # a tie is not a 0/1 score


def test_clustered_errors_group_the_samples_of_a_prompt_and_singletons_change_nothing():
    rng = random.Random(3)
    a, b, clusters = {}, {}, {}
    for prompt in range(23):
        shift = rng.gauss(0, 1)  # the prompt's samples move together
        for sample in range(rng.randint(1, 4)):  # uneven cluster sizes
            key = (prompt, sample)
            a[key], b[key], clusters[key] = rng.gauss(0, 1), shift + rng.gauss(0, 0.3), prompt
    got = paired_difference(a, b, clusters)
    d = {k: b[k] - a[k] for k in a}
    mean = np.mean(list(d.values()))
    sums = np.array([sum(v - mean for k, v in d.items() if k[0] == g) for g in range(23)])
    expected = math.sqrt(23 / 22 * (sums**2).sum()) / len(d)
    assert got.clusters == 23 and got.stderr == pytest.approx(expected, rel=1e-12)
    assert got.stderr > paired_difference(a, b).stderr  # ignoring the clusters understates it
    singletons = paired_difference(a, b, {k: k for k in a})
    assert singletons.stderr == pytest.approx(paired_difference(a, b).stderr, rel=1e-12)


def test_only_common_items_are_paired_and_none_in_common_is_refused_by_name():
    got = paired_difference({1: 1.0, 2: 0.0, 3: 1.0}, {2: 1.0, 3: 1.0, 4: 0.0})
    assert got.n == 2 and got.difference == 0.5
    with pytest.raises(NoCommonItems, match="steps 4 and 8 share no items"):
        paired_difference({1: 1.0}, {2: 1.0}, what="steps 4 and 8")
    same = paired_difference({1: 1.0, 2: 0.0}, {1: 1.0, 2: 0.0})
    assert same.stderr == 0 and same.z == 0 and same.mcnemar_p == 1.0


def test_paired_stderrs_reads_each_step_once_and_says_none_where_items_are_missing():
    from areal_eval.paired import paired_stderrs

    scores = {0: {0: 1.0, 1: 0.0, 2: 1.0, 3: 0.0}, 5: {0: 1.0, 1: 1.0, 2: 1.0, 3: 0.0}, 9: {7: 1.0}}
    reads = []

    def items(step, metric):
        reads.append(step)
        return (scores[step], None) if step in scores and metric == "accuracy" else None

    paired = paired_stderrs(items, "accuracy")
    expected = paired_difference(scores[5], scores[0]).stderr
    assert paired(5, 0) == expected == paired(5, 0) == paired(0, 5) and reads == [5, 0]
    assert paired(5, 3) is None  # step 3 kept no items
    assert paired(5, 9) is None  # no item in common
    assert paired_stderrs(items, "loss")(5, 0) is None


def test_the_guarded_error_adds_one_item_changed_by_the_largest_change_either_way():
    a, b = correlated(57, 3, lift=0.1)
    got = paired_difference(a, b)
    d = np.array([b[i] - a[i] for i in range(57)])
    squares = np.sum((d - d.mean()) ** 2) + np.abs(d).max() ** 2
    assert got.guarded_stderr == pytest.approx(math.sqrt(squares / (57 * 58)), rel=1e-12)
    # Four of 400 lost, none gained: the plain error says 2 standard errors; McNemar says it is
    # an even split's 1 in 8. The guarded error does not call it 2.
    a = {i: 1.0 for i in range(400)}
    b = {i: 0.0 if i < 4 else 1.0 for i in range(400)}
    few = paired_difference(a, b)
    assert few.z == pytest.approx(-2.0, abs=0.01) and few.mcnemar_p == pytest.approx(0.125)
    assert abs(few.difference) / few.guarded_stderr < 1.85
    # Where many items change it is within a few percent of the plain error.
    many = paired_difference(*correlated(400, 4, lift=0.1))
    assert 1.0 < many.guarded_stderr / many.stderr < 1.03


def test_a_clustered_guarded_error_moves_one_more_cluster_by_the_largest_cluster_change():
    a, b = correlated(60, 5, lift=0.2)
    clusters = {i: i // 3 for i in range(60)}
    got = paired_difference(a, b, clusters)
    d = np.array([b[i] - a[i] for i in range(60)]).reshape(20, 3)
    sums, deviations = d.sum(axis=1), (d - d.mean()).sum(axis=1)
    expected = math.sqrt(21 / 20 * (np.sum(deviations**2) + np.abs(sums).max() ** 2)) / 60
    assert got.guarded_stderr == pytest.approx(expected, rel=1e-12)
    assert got.guarded_stderr > got.stderr


def test_mcnemar_z_is_the_normal_deviate_of_the_exact_p(stats):
    a = {i: 1.0 for i in range(400)}
    for lost in (4, 24):
        b = {i: 0.0 if i < lost else 1.0 for i in range(400)}
        got = paired_difference(a, b)
        assert got.mcnemar_z == pytest.approx(stats.norm.isf(got.mcnemar_p / 2), rel=1e-9)
    # Four lost: below the plain z (2.0); 24 lost, none gained: above it (5.05).
    assert paired_difference(a, {i: 0.0 if i < 4 else 1.0 for i in range(400)}).mcnemar_z < 1.6
    many = paired_difference(a, {i: 0.0 if i < 24 else 1.0 for i in range(400)})
    assert abs(many.z) < many.mcnemar_z and many.mcnemar_z > 5.2
    assert paired_difference(a, a).mcnemar_z == 0.0
    assert paired_difference({0: 0.5, 1: 1.0}, {0: 1.0, 1: 1.0}).mcnemar_z is None  # a tie is no 0/1 score
    a, b = {i: 1.0 for i in range(6)}, {i: 0.0 if i < 3 else 1.0 for i in range(6)}
    assert paired_difference(a, b, {i: i // 3 for i in range(6)}).mcnemar_z is None  # one prompt's samples
    assert paired_difference(a, b, {i: i for i in range(6)}).mcnemar_p == pytest.approx(0.25)  # singletons


def test_mean_scores_average_each_item_over_the_evaluations_that_all_scored_it():
    means = mean_scores([{"a": 1.0, "b": 0.0, "c": 1.0}, {"a": 0.0, "b": 0.0}, {"b": 1.0, "a": 1.0, "d": 1.0}])
    assert means == {"a": pytest.approx(2 / 3), "b": pytest.approx(1 / 3)}
    assert mean_scores([{"x": 0.25}]) == {"x": 0.25}
