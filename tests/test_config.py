import pytest

from areal_eval.config import ConfigError, flatten, parse_overrides
from areal_eval.pipeline_config import PipelineConfig, load_pipeline_config


def test_defaults_build():
    cfg = load_pipeline_config()
    assert isinstance(cfg, PipelineConfig)
    assert cfg.train.nproc == 2 and cfg.eval.nproc == 2


def test_unknown_field_is_named():
    with pytest.raises(ConfigError, match=r"train\.save\.freq_step\b"):
        load_pipeline_config(params={"train": {"save": {"freq_step": 3}}})


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match=r"eval\.nproc: expected int"):
        load_pipeline_config(overrides=['eval.nproc="two"'])


def test_invalid_value_is_named():
    with pytest.raises(ConfigError, match=r"alerts\.rules\[0\]\.kind"):
        load_pipeline_config(params={"alerts": {"rules": [{"name": "x", "kind": "sometimes"}]}})
    with pytest.raises(ConfigError, match="label_noise"):
        load_pipeline_config(overrides=["data.synthetic.label_noise=0.7"])
    with pytest.raises(ConfigError, match="divisible"):
        load_pipeline_config(overrides=["eval.nproc=3", "eval.mp_size=2"])


def test_config_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "cfg.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="cfg.yaml"):
        load_pipeline_config(bad)


def test_file_then_overrides(tmp_path):
    f = tmp_path / "cfg.json"
    f.write_text('{"run_name": "a", "train": {"epochs": 5}}')
    cfg = load_pipeline_config(f, overrides=["train.epochs=2"])
    assert (cfg.run_name, cfg.train.epochs) == ("a", 2)


def test_overrides_and_flatten():
    assert parse_overrides(["a.b=3", "a.c=x"]) == {"a": {"b": 3, "c": "x"}}
    assert flatten({"a": {"b": 1}, "c": 2}) == {"a.b": 1, "c": 2}
