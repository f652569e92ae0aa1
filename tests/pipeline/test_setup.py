"""Setting up a run directory, and the settings a run is judged by on every path."""

import json
from pathlib import Path

import pytest

from areal_eval.pipeline.config import deployment_config_path, load_pipeline_config
from areal_eval.pipeline.setup import check_inputs, prepare_run, recorded_evaluation_settings, run_evaluation_config
from areal_eval.runs.directory import RunDir

SFT_MATH = Path(__file__).resolve().parents[2] / "configs" / "sft-math.yaml"
SMALL_SFT = {
    "model": {"objective": "sft", "hidden_size": 16, "num_layers": 1, "num_heads": 2},
    "data": {"math": {"train_problems": 50, "valid_problems": 5}},
}


def test_an_sft_run_gets_prompt_rows_a_tokenizer_and_its_config_recorded(tmp_path):
    params = {**SMALL_SFT, "work_dir": str(tmp_path), "run_name": "sft"}
    cfg = load_pipeline_config(SFT_MATH, params)
    run = prepare_run(cfg)
    first = json.loads(run.valid_data.read_text().splitlines()[0])
    assert first["answer"].split("####")[1].strip().isdigit() and first["prompt"].endswith("\nA:")
    assert (run.tokenizer / "tokenizer.json").exists()
    assert json.loads(run.config_file.read_text())["eval"]["evaluator"] == "generation,lm_loss"


def test_every_path_judges_a_run_by_what_it_was_started_with_unless_told_otherwise(tmp_path):
    params = {**SMALL_SFT, "work_dir": str(tmp_path), "run_name": "sft"}
    run = prepare_run(load_pipeline_config(SFT_MATH, params))
    judging = recorded_evaluation_settings(run)
    assert set(judging) == {"eval", "model", "scheduler", "alerts", "tracking", "feedback"}
    assert "tracking_uri" not in judging["tracking"]  # the server's address is the path's
    assert set(judging["eval"]) == {"evaluator", "generation", "lm_loss", "lm_eval"}  # not nproc, not deployment
    cfg = run_evaluation_config(run, {"eval": {"nproc": 1}})
    assert cfg.eval.evaluator == "generation,lm_loss" and cfg.eval.nproc == 1
    assert cfg.scheduler.metric == "generation/accuracy" and cfg.alerts.rules[2].metric == "generation/accuracy"
    assert cfg.eval.generation.n_samples == 4
    told = run_evaluation_config(
        run, {"eval": {"evaluator": "lm_loss"}, "scheduler": {"metric": "loss"}, "alerts": {"rules": []}}
    )
    assert told.eval.evaluator == "lm_loss" and told.scheduler.stderr_name == "loss_stderr"
    unrecorded = RunDir(tmp_path / "published-by-a-trainer")
    assert (
        recorded_evaluation_settings(unrecorded) == {}
        and run_evaluation_config(unrecorded, None).eval.evaluator == "reward_model"
    )


def test_given_prompt_rows_are_checked_by_line_for_an_sft_run(tmp_path):
    from areal_eval.data.preference_data import DataError

    bad = tmp_path / "train.jsonl"
    bad.write_text('{"prompt": "Q: 1 + 1?\\nA:", "answer": " 2"}\n{"prompt": "Q: 2 + 2?"}\n')
    cfg = load_pipeline_config(SFT_MATH, {"data": {"train_path": str(bad)}})
    with pytest.raises(DataError, match=rf"{bad}:2: no 'answer'"):
        check_inputs(cfg)


def test_validation_data_is_checked_as_each_evaluator_reads_it_and_kept_whole(tmp_path):
    from areal_eval.data.preference_data import DataError

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"question": "Q: 1 + 1?\\nA:", "answer": "#### 2", "source": "gsm8k"}\n')
    external = {"work_dir": str(tmp_path), "train": {"external": True}, "data": {"valid_path": str(prompts)}}
    generation = {"eval": {"evaluator": "generation"}, "alerts": {"rules": []}}
    run = prepare_run(load_pipeline_config(params={**external, **generation}))
    assert run.valid_data.read_bytes() == prompts.read_bytes()  # every field kept, GSM8K form and all
    both = {"eval": {"evaluator": "generation,lm_loss"}, "scheduler": {"metric": "generation/accuracy"}}
    with pytest.raises(DataError, match=rf"{prompts}:1: expected 'text', or 'prompt' and 'completion'"):
        check_inputs(load_pipeline_config(params={**external, **both, "alerts": {"rules": []}}))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"chosen": "a", "rejected": "b"}\n')
    with pytest.raises(DataError, match=rf"{pairs}:1: no 'answer'"):
        check_inputs(load_pipeline_config(params={**generation, "data": {"valid_path": str(pairs)}}))


def test_a_paths_config_file_is_under_a_runs_recorded_settings_and_its_params_over_both(tmp_path):
    file = tmp_path / "server.yaml"
    file.write_text("eval:\n  nproc: 1\ntracking:\n  sinks: [mlflow, tensorboard]\nscheduler:\n  metric: loss\n")
    alone = RunDir(tmp_path / "published-by-a-trainer")  # recorded nothing: the file decides
    cfg = run_evaluation_config(alone, None, config_path=str(file))
    assert cfg.eval.nproc == 1 and cfg.tracking.sinks == ["mlflow", "tensorboard"] and cfg.scheduler.metric == "loss"
    params = {**SMALL_SFT, "work_dir": str(tmp_path), "run_name": "sft", "tracking": {"sinks": ["mlflow", "wandb"]}}
    started = prepare_run(load_pipeline_config(SFT_MATH, params))
    cfg = run_evaluation_config(started, {"eval": {"nproc": 3}}, config_path=str(file))
    assert cfg.tracking.sinks == ["mlflow", "wandb"]  # where its results went when it started
    assert cfg.scheduler.metric == "generation/accuracy" and cfg.eval.evaluator == "generation,lm_loss"
    assert cfg.eval.nproc == 3  # params over everything; the file's ranks when they say nothing
    assert run_evaluation_config(started, None, config_path=str(file)).eval.nproc == 1
    from areal_eval.config.parsing import ConfigError

    with pytest.raises(ConfigError, match="no-such.yaml: no such config file"):
        run_evaluation_config(alone, None, config_path=str(tmp_path / "no-such.yaml"))


def test_a_deployments_config_path_left_unrendered_by_prefect_deploy_means_none_and_says_why():
    assert deployment_config_path(None) == (None, None) and deployment_config_path("") == (None, None)
    assert deployment_config_path("/etc/areal.yaml") == ("/etc/areal.yaml", None)
    path, note = deployment_config_path("{{ $AREAL_EVAL_CONFIG }}")
    assert path is None and note.startswith("config_path: $AREAL_EVAL_CONFIG was not set when the deployment was made")
