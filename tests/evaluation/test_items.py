"""Per-item files: written, cut to the size policy, found again, and read as a metric's scores."""

from areal_eval.checkpoints.manifest import checkpoint_name
from areal_eval.evaluation.items import (
    items_dir,
    metric_scores,
    read_items,
    run_item_scores,
    stored_items,
    write_items,
)

ANSWERS = [
    {"item": p, "sample": s, "greedy": s == 0, "reward": float(p == s), "length": 4, "answer": "a" * 50}
    for p in range(3)
    for s in range(3)
]
PAIRS = [{"item": i, "correct": [1.0, 0.5, 0.0][i], "margin": 0.1 * i, "loss": 0.2} for i in range(3)]


def write_step(evals, step, text_chars=10):
    return write_items(
        {"generation": ANSWERS, "reward_model": PAIRS, "my.pkg:Eval": PAIRS},
        items_dir(evals / f"{checkpoint_name(step)}.json"),
        text_chars,
    )


def test_files_are_found_by_step_and_texts_are_cut_to_the_size_policy(tmp_path):
    written = write_step(tmp_path, 40)
    # Found again by step (a custom evaluator by its file's name), or none at a step never evaluated.
    assert set(stored_items(tmp_path, 40).values()) == set(written.values()) and stored_items(tmp_path, 41) == {}
    assert sorted(p.rsplit("/", 1)[1] for p in written.values()) == [
        "generation.parquet", "my.pkg_Eval.parquet", "reward_model.parquet"
    ]  # fmt: skip
    rows = read_items(written["generation"])
    assert [r["answer"] for r in rows] == ["a" * 10] * 9 and rows[4]["reward"] == 1.0
    whole = write_items({"generation": ANSWERS}, tmp_path / "whole", None)
    assert read_items(whole["generation"])[0]["answer"] == "a" * 50


def test_a_metric_reads_the_scores_it_is_the_mean_of(tmp_path):
    files = write_step(tmp_path, 8)
    greedy, clusters = metric_scores(files, "generation/accuracy")
    assert greedy == {(0, 0): 1.0, (1, 0): 0.0, (2, 0): 0.0} and clusters is None
    sampled, clusters = metric_scores(files, "generation/mean_reward")
    assert len(sampled) == 6 and clusters == {k: k[0] for k in sampled}  # a prompt's samples: one cluster
    assert metric_scores(files, "reward_model/accuracy")[0] == {(0, 0): 1.0, (1, 0): 0.5, (2, 0): 0.0}
    assert metric_scores({"reward_model": files["reward_model"]}, "accuracy")[0][(1, 0)] == 0.5
    assert metric_scores(files, "accuracy") is None  # unprefixed, but three evaluators: ambiguous
    assert metric_scores(files, "reward_model/chosen_score") is None  # not a mean of a column
    assert metric_scores(files, "lm_loss/loss") is None  # no such file
    scores = run_item_scores(tmp_path)
    assert scores(8, "reward_model/margin")[0][(2, 0)] == 0.2 and scores(9, "reward_model/margin") is None
