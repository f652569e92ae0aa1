"""``areal-eval compare``: two steps' per-item files, paired, as the command prints them."""

import json

import pytest

from areal_eval.checkpoints.manifest import checkpoint_name
from areal_eval.cli import main
from areal_eval.compare import compare_steps
from areal_eval.evaluation.items import items_dir, write_items
from areal_eval.paired import paired_difference


def evaluation(run_dir, step, correct, answers):
    """Per-item files as the worker writes them: a reward model's pairs and generation answers
    (a greedy answer and two samples per prompt)."""
    tables = {
        "reward_model": [{"item": i, "correct": c, "margin": c - 0.5, "loss": 1 - c} for i, c in enumerate(correct)],
        "generation": [
            {"item": p, "sample": s, "greedy": s == 0, "reward": r, "length": 3, "truncated": False, "answer": "x"}
            for p, rewards in enumerate(answers)
            for s, r in enumerate(rewards)
        ],
    }
    write_items(tables, items_dir(run_dir / "evals" / f"{checkpoint_name(step)}.json"), 2000)


def test_compare_pairs_each_score_on_common_items_and_clusters_a_prompts_samples(tmp_path, capsys):
    evaluation(tmp_path, 10, [1, 0, 0, 1, 0, 1, 0], [[0, 1, 0], [1, 1, 0], [0, 0, 0]])
    evaluation(tmp_path, 20, [1, 1, 1, 1, 0, 1, 1], [[1, 1, 1], [1, 1, 1], [0, 1, 0]])
    got = {(c.evaluator, c.score): c.result for c in compare_steps(tmp_path, 10, 20)}
    assert got[("reward_model", "accuracy")] == paired_difference(
        dict(enumerate([1, 0, 0, 1, 0, 1, 0])), dict(enumerate([1, 1, 1, 1, 0, 1, 1]))
    )
    assert got[("reward_model", "accuracy")].mcnemar_p == pytest.approx(0.25)  # 3 up, 0 down
    greedy, sampled = got[("generation", "accuracy")], got[("generation", "mean_reward")]
    assert (greedy.n, greedy.mean_a, greedy.mean_b, greedy.clusters) == (3, 1 / 3, 2 / 3, None)
    assert (sampled.n, sampled.clusters) == (6, 3) and sampled.difference == pytest.approx(5 / 6 - 2 / 6)
    assert main(["compare", str(tmp_path), "10", "20"]) == 0
    table = capsys.readouterr().out
    assert "step 10 -> step 20" in table and "McNemar p" in table
    assert any(line.startswith("reward_model  accuracy") and "0.25" in line for line in table.splitlines())
    assert main(["compare", str(tmp_path), "10", "20", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["evaluator"], r["score"]) for r in rows} == set(got)


def test_a_step_without_items_or_without_common_items_is_refused_naming_it(tmp_path, capsys):
    evaluation(tmp_path, 10, [1, 0], [[1, 0, 0]])
    assert main(["compare", str(tmp_path), "10", "30"]) == 2
    err = capsys.readouterr().err
    assert "step 30: no per-item results in" in err and f"steps of {tmp_path} with items: 10" in err
    assert main(["compare", str(tmp_path / "nope"), "10", "30"]) == 2
    assert f"{tmp_path / 'nope'}: not a run directory with evaluations" in capsys.readouterr().err
    write_items({"reward_model": [{"item": 5, "correct": 1.0, "margin": 0.0, "loss": 0.0}]},
                items_dir(tmp_path / "evals" / f"{checkpoint_name(40)}.json"), 2000)  # fmt: skip
    assert main(["compare", str(tmp_path), "10", "40"]) == 2
    assert "steps 10 and 40 (reward_model accuracy) share no items" in capsys.readouterr().err


def test_a_new_best_says_whether_it_is_distinguishable_from_the_best_before_it(tmp_path):
    from areal_eval.compare import versus_previous_best

    evaluation(tmp_path, 10, [0] * 40 + [1] * 10, [[0, 0, 0]])
    evaluation(tmp_path, 20, [1] * 40 + [1] * 10, [[1, 0, 0]])  # 40 more pairs right
    evaluation(tmp_path, 30, [1] * 39 + [0] + [1] * 10, [[1, 0, 0]])  # 1 less: within the noise
    clear = versus_previous_best(tmp_path / "evals", 10, 20, "reward_model/accuracy")
    assert clear["vs_previous_best.step"] == "10" and clear["vs_previous_best.distinguishable"] == "true"
    assert float(clear["vs_previous_best.difference"]) == pytest.approx(0.8)
    close = versus_previous_best(tmp_path / "evals", 30, 20, "reward_model/accuracy")
    assert close["vs_previous_best.distinguishable"] == "false" and "[" in close["vs_previous_best.ci95"]
    assert close["vs_previous_best"].endswith("over the best before it (step 30): within the noise")
    # No items kept for the metric (or at a step): said, not guessed.
    unknown = versus_previous_best(tmp_path / "evals", 10, 99, "reward_model/accuracy")
    assert unknown["vs_previous_best.distinguishable"] == "unknown" and "no items" in unknown["vs_previous_best"]


def test_lm_eval_documents_are_paired_by_task_metric_and_doc_id(tmp_path):
    from areal_eval.evaluation.items import metric_scores, stored_items

    def harness(step, acc):
        rows = [
            {"item": i, "task": "arith_mc", "doc_id": i, "filter": "none", "target": "1", "acc": a, "acc_norm": a}
            for i, a in enumerate(acc)
        ]
        write_items({"lm_eval": rows}, items_dir(tmp_path / "evals" / f"{checkpoint_name(step)}.json"), 2000)

    harness(10, [0, 0, 1, 0, 1, 0])
    harness(20, [1, 0, 1, 1, 1, 1])
    got = {c.score: c.result for c in compare_steps(tmp_path, 10, 20)}
    assert set(got) == {"arith_mc/acc", "arith_mc/acc_norm"}
    assert got["arith_mc/acc"] == paired_difference(
        dict(enumerate([0, 0, 1, 0, 1, 0])), dict(enumerate([1, 0, 1, 1, 1, 1]))
    )
    scores, clusters = metric_scores(stored_items(tmp_path / "evals", 20), "arith_mc/acc")  # what paired alerts read
    assert scores == dict(enumerate([1.0, 0.0, 1.0, 1.0, 1.0, 1.0])) and clusters is None
    assert metric_scores(stored_items(tmp_path / "evals", 20), "lm_eval/arith_mc/acc")[0] == scores
    assert metric_scores(stored_items(tmp_path / "evals", 20), "arith_mc/nope") is None
