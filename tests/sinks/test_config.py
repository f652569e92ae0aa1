"""``tracking.sinks`` and each sink's settings: a bad one is refused in one line naming the field."""

from __future__ import annotations

import importlib.util

import pytest

from areal_eval.config.parsing import ConfigError
from areal_eval.pipeline.config import load_pipeline_config
from areal_eval.tracking import resolve_tracking_uri


def tracking(**fields):
    return load_pipeline_config(params={"tracking": fields}).tracking


def test_any_combination_is_taken_and_the_settings_keep_their_defaults():
    cfg = tracking(sinks=["mlflow", "wandb", "tensorboard"], wandb={"mode": "offline", "run_id": "abc"})
    assert cfg.sinks == ["mlflow", "wandb", "tensorboard"] and cfg.wandb.run_id == "abc" and cfg.to_mlflow
    assert cfg.tensorboard.directory("/runs/r1").as_posix() == "/runs/r1/tensorboard/areal-eval"
    assert tracking().sinks == ["mlflow"] and tracking().to_mlflow
    for sinks in (["wandb"], ["tensorboard"], ["tensorboard", "wandb"]):
        assert tracking(sinks=sinks).sinks == sinks and not tracking(sinks=sinks).to_mlflow


def test_without_mlflow_the_runs_record_stays_in_the_work_dir_whatever_the_environment_names(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert resolve_tracking_uri(tracking(), "/work") == "http://127.0.0.1:5999"
    assert resolve_tracking_uri(tracking(sinks=["tensorboard"]), "/work") == "sqlite:////work/mlflow.db"


@pytest.mark.parametrize(
    ("fields", "line"),
    [
        ({"sinks": []}, "tracking.sinks: names no sink: results would be seen nowhere"),
        ({"sinks": ["wandb"], "tracking_uri": "http://mlflow"}, "tracking.tracking_uri: set, but mlflow is not in"),
        ({"sinks": ["mlflow", "neptune"]}, "tracking.sinks: 'neptune' is not one of mlflow, wandb, tensorboard"),
        ({"sinks": ["mlflow", "wandb", "wandb"]}, "tracking.sinks: ['mlflow', 'wandb', 'wandb'] names a sink twice"),
        ({"wandb": {"mode": "cloud"}}, "tracking.wandb.mode: 'cloud' is not one of online, offline, disabled"),
        ({"wandb": {"answers_per_table": -1}}, "tracking.wandb.answers_per_table: must be >= 0, got -1"),
        ({"wandb": {"init_timeout_s": 0}}, "tracking.wandb.init_timeout_s: must be > 0, got 0"),
        ({"tensorboard": {"subdir": "../up"}}, "tracking.tensorboard.subdir: '../up' is not a directory name"),
    ],
)
def test_a_bad_setting_is_one_line_naming_its_field(fields, line):
    with pytest.raises(ConfigError) as info:
        tracking(**fields)
    assert str(info.value).startswith(line) and "\n" not in str(info.value)


def test_a_sink_without_its_package_is_refused_saying_how_to_get_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(
        ConfigError,
        match=r"tracking.sinks: wandb needs the wandb package, not installed here: pip install 'areal-eval\[wandb\]'",
    ):
        tracking(sinks=["mlflow", "wandb"])
