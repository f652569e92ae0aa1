"""The causal-LM demo's preset (sft-math) through the train-and-evaluate flow and through
evaluate-checkpoint, against the Prefect test API, MLflow on SQLite and torchrun workers."""

import json
from pathlib import Path

import pytest

from areal_eval.evaluation.items import stored_items
from areal_eval.pipeline.config import load_pipeline_config
from areal_eval.runs.directory import RunDir
from areal_eval.runs.ledger import FINAL_STATES, Ledger
from tests.helpers import copy_trained_run, mlflow_run, sqlite_mlflow_uri


def test_the_sft_math_preset_is_judged_alike_in_the_flow_and_by_evaluate_checkpoint(prefect_server, tmp_path):
    """The causal-LM demo, scaled down: SFT on 2 ranks, generation and lm_loss on warm workers,
    then evaluate-checkpoint on a copy of the run, given no evaluator settings: it judges the run
    by the ones the run was started with."""
    from areal_eval.config.parsing import merge, read_file
    from flows.evaluate_checkpoint import evaluate_checkpoint
    from flows.train_and_evaluate import PRESETS, train_and_evaluate

    small = {
        "work_dir": str(tmp_path),
        "tracking": {"tracking_uri": sqlite_mlflow_uri(tmp_path)},
        "data": {"math": {"train_problems": 640, "valid_problems": 21}},
        "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2},
        "train": {"epochs": 1, "max_steps": 15, "log_every": 5, "save": {"freq_steps": 5}},
        "eval": {"generation": {"max_new_tokens": 12}},
        "scheduler": {"min_interval_steps": 0, "max_interval_steps": 10},
        "poll_interval_s": 0.2,
    }
    params = merge(read_file(PRESETS["sft-math"]), small)
    state = train_and_evaluate(params=params, return_state=True)
    assert state.is_completed(), state
    run = RunDir(tmp_path / "sft-math")
    ledger = Ledger(run.ledger)
    assert [e.step for e in ledger.entries()] == [0, 5, 10, 15]
    assert all(e.status in FINAL_STATES for e in ledger.entries())
    evaluated = [e.step for e in ledger.entries() if e.status == "evaluated"]
    tracker, [mlflow] = mlflow_run(load_pipeline_config(params=params))
    for metric in ("generation/accuracy", "generation/pass_at_4", "generation/maj_at_4", "lm_loss/loss"):
        history = tracker.client.get_metric_history(mlflow.info.run_id, f"eval/{metric}")
        assert sorted(m.step for m in history) == evaluated, metric  # each evaluated step once
    assert mlflow.info.status == "FINISHED"
    # Every evaluated step's answers are in MLflow: its per-item files and a table to read.
    run_id = mlflow.info.run_id
    for step in evaluated:
        stored = {a.path for a in tracker.client.list_artifacts(run_id, f"items/step_{step:08d}")}
        assert stored == {f"items/step_{step:08d}/generation.parquet", f"items/step_{step:08d}/lm_loss.parquet"}
    last = evaluated[-1]
    tracker.log_items(run_id, last, stored_items(run.evals, last))  # a retried delivery: the table stays whole
    local = tracker.client.download_artifacts(run_id, f"items/generation_step_{last:08d}.json", str(tmp_path / "dl"))
    table = json.loads(Path(local).read_text())  # MLflow's table form: columns, then rows
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    assert len(rows) == 21 * 5 and {"prompt", "reference", "answer", "reward"} <= set(table["columns"])
    greedy = [r["reward"] for r in rows if r["greedy"]]
    accuracy = tracker.eval_history(run_id, "generation/accuracy")[last]
    assert sum(greedy) / len(greedy) == pytest.approx(accuracy, abs=1e-9)

    copy = copy_trained_run(run, tmp_path / "copy" / "sft-math", run_id="sft-math-copy")
    result = evaluate_checkpoint(15, str(copy.manifest), params={"tracking": small["tracking"]})
    assert result["evaluated"] and result["metrics"]["generation/n_prompts"] == 21
    assert set(result["metrics"]) == {k.removeprefix("eval/") for k in mlflow.data.metrics if k.startswith("eval/")}
