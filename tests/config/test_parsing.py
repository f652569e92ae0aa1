import pytest

from areal_eval.config.parsing import ConfigError, flatten, parse_overrides
from areal_eval.pipeline.config import PipelineConfig, load_pipeline_config


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


def test_a_list_or_mapping_override_may_be_written_as_the_yaml_file_writes_it():
    cfg = load_pipeline_config(overrides=["alerts.rules=[{name: nan, kind: nonfinite, stop_training: true}]"])
    assert [(r.name, r.kind, r.stop_training) for r in cfg.alerts.rules] == [("nan", "nonfinite", True)]
    assert parse_overrides(['a.b={"c": [1, 2]}', "a.d=no"]) == {"a": {"b": {"c": [1, 2]}, "d": "no"}}
    with pytest.raises(ConfigError, match=r"alerts\.rules: '\[\{name: a, kind: ' is neither JSON nor a YAML list"):
        parse_overrides(["alerts.rules=[{name: a, kind: "])


@pytest.mark.parametrize(
    "override, named",
    [
        ("train.max_steps=-5", r"train\.max_steps: must be >= 1, got -5"),
        ("train.max_steps=0", r"train\.max_steps: must be >= 1, got 0"),  # 0 never means "all"
        ("train.nproc=0", r"train\.nproc: must be in \[1, 1024\], got 0"),
        ("train.batch_size=0", r"train\.batch_size: must be in \[1, 65536\]"),
        ("train.epochs=-1", r"train\.epochs: must be >= 1"),
        ("train.save.freq_steps=0", r"train\.save\.freq_steps: must be >= 1"),
        ("eval.batch_size=0", r"eval\.batch_size: must be in \[1, 65536\]"),
        ("eval.nproc=100000", r"eval\.nproc: must be in \[1, 1024\], got 100000"),  # upper bounds
        ("eval.slots=100000", r"eval\.slots: must be in \[1, 64\]"),
        ("train.batch_size=1000000000000", r"train\.batch_size: must be in \[1, 65536\]"),
        ("eval.generation.max_new_tokens=1e12", r"eval\.generation\.max_new_tokens: expected int"),
        ("poll_interval_s=1e400", r"poll_interval_s: must be a finite number, got inf"),  # only finite numbers
        ("train.lr=1e400", r"train\.lr: must be a finite number"),
        ("train.lr=NaN", r"train\.lr: must be a finite number, got nan"),
        ("eval.retries=-1", r"eval\.retries: must be >= 0"),
        ("scheduler.min_interval_steps=-1", r"scheduler\.min_interval_steps: must be >= 0"),
        (
            "scheduler.min_interval_steps=50 scheduler.max_interval_steps=10",
            r"scheduler\.max_interval_steps: must be >= min_",
        ),
        ("storage.retention.keep_last=0", r"storage\.retention\.keep_last: must be >= 1"),
        ("scheduler.probe_fraction=1", r"scheduler\.probe_fraction: must be in \(0, 1\), got 1"),
        ("scheduler.probe_escalate_stderrs=-1", r"scheduler\.probe_escalate_stderrs: must be >= 0"),
        ("model.num_heads=3", r"model\.hidden_size: 128 must be divisible by num_heads"),
        ("poll_interval_s=0", r"poll_interval_s: must be > 0, got 0"),
        ('run_name="../elsewhere"', r"run_name: '\.\./elsewhere' must be a plain name"),
        ("run_name=" + "x" * 300, r"run_name: 'x{120}' must be a plain name: .* at most 100 characters"),
    ],
)
def test_numbers_are_range_checked_naming_the_field(override, named):
    with pytest.raises(ConfigError, match=named):
        load_pipeline_config(overrides=override.split())


def test_rules_on_metrics_the_evaluator_never_produces_are_refused():
    typo = {"name": "acc-low", "kind": "threshold", "metric": "acuracy", "op": "<", "value": 0.5}
    with pytest.raises(ConfigError, match=r"alerts\.rules\[0\]\.metric: 'acuracy' is not a metric of evaluator"):
        load_pipeline_config(params={"alerts": {"rules": [typo]}})
    with pytest.raises(ConfigError, match=r"scheduler\.metric: 'acc'"):
        load_pipeline_config(overrides=["scheduler.metric=acc"])
    custom = load_pipeline_config(
        params={
            "eval": {"evaluator": "tests.custom_evaluator:MarginOver"},
            "alerts": {"rules": [{**typo, "metric": "margin_over_0.1"}]},
        }
    )
    assert custom.alerts.rules[0].metric == "margin_over_0.1"  # undeclared metrics are not checked
    with pytest.raises(ConfigError, match=r"eval\.evaluator: 'nowhere:Nothing' cannot be loaded"):
        load_pipeline_config(overrides=["eval.evaluator=nowhere:Nothing"])


def test_probes_need_an_evaluator_that_can_evaluate_a_subset():
    probing = ["scheduler.probe_fraction=0.2"]
    assert load_pipeline_config(overrides=probing).scheduler.probe_fraction == 0.2  # reward_model can
    lm_eval = ["eval.evaluator=lm_eval", 'eval.lm_eval.tasks=["arith"]', "scheduler.metric=arith/acc"]
    with pytest.raises(ConfigError, match=r"scheduler\.probe_fraction: evaluator 'lm_eval' cannot evaluate a subset"):
        load_pipeline_config(overrides=probing + lm_eval)


@pytest.mark.parametrize(
    "url",
    [
        "http://user:pass@hooks.example/x",
        "https://hooks.example/x?token=abc",
        "https://hooks.slack.com/services/T0/B0/TOKEN",  # the token is the path
        "http://127.0.0.1:8080/hooks/T0/B0/TOKEN",
        "https://hooks.example/#token",
    ],
)
def test_a_webhook_url_that_may_hold_a_secret_is_refused_in_plain_config_and_in_the_form(url):
    from pydantic import ValidationError

    from areal_eval.pipeline.schema import PipelineParams

    with pytest.raises(ConfigError, match=r"alerts\.webhook_url: may hold only scheme://host:port.*webhook_url_env"):
        load_pipeline_config(overrides=[f"alerts.webhook_url={url}"])
    with pytest.raises(ValidationError, match="webhook_url"):  # a server refuses it at submission: never stored
        PipelineParams.model_validate({"alerts": {"webhook_url": url}})
    assert load_pipeline_config(params={"alerts": {"webhook_url": "http://alerts.internal:8080/"}})
