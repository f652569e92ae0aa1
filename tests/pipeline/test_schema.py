"""The config as the typed parameter of the flows: a described form, strict validation."""

import dataclasses
import typing

import pytest
from pydantic import ValidationError

from areal_eval.evaluation.jobs import EvalConfig
from areal_eval.pipeline.config import PipelineConfig, load_pipeline_config
from areal_eval.pipeline.schema import PipelineParams, field_docs, set_fields


def test_every_field_has_its_docstring_as_description():
    assert field_docs(EvalConfig)["nproc"].startswith("Evaluation ranks per node")
    schema = PipelineParams.model_json_schema()
    eval_fields = schema["$defs"]["EvalConfig"]["properties"]
    assert all(field.get("description") for field in eval_fields.values())
    # The pipeline's default, said in the description; the schema itself carries no defaults, so a
    # form starts empty and sends back only what is filled in.
    scheduler = schema["$defs"]["SchedulerConfig"]["properties"]["min_interval_steps"]
    assert scheduler["description"].endswith("Default: 25.") and "default" not in scheduler
    assert (
        "default" not in schema["properties"]["run_name"]
        and 'Default: "demo".' in schema["properties"]["run_name"]["description"]
    )


@pytest.mark.parametrize(
    "params, where",
    [
        ({"eval": {"nproc": True}}, "eval.nproc"),  # a bool is not an int
        ({"eval": {"nproc": "2"}}, "eval.nproc"),
        ({"eval": {"nprocs": 2}}, "eval.nprocs"),  # unknown, refused by its dotted path
        ({"alerts": {"rules": [{"name": "x", "kind": "sometimes"}]}}, "alerts.rules.0.kind"),
        ({"eval": {"nproc": 0}}, "eval.nproc"),  # out of its range
        ({"train": {"lr": float("inf")}}, "train.lr"),  # not finite
        ({"eval": {"nproc": 100000}}, "eval.nproc"),  # past its upper bound
        ({"train": {"lr": 0.0}}, "train.lr"),
        ({"scheduler": {"probe_fraction": 1.5}}, "scheduler.probe_fraction"),
        ({"scheduler": {"probe_fraction": 1.0}}, "scheduler.probe_fraction"),  # its ends are excluded
        ({"scheduler": {"max_interval_steps": 0}}, "scheduler.max_interval_steps"),
        ({"alerts": {"rules": [{"name": "x", "kind": "regression", "stderrs": -1}]}}, "alerts.rules.0.stderrs"),
    ],
)
def test_bad_params_are_refused_naming_the_field(params, where):
    with pytest.raises(ValidationError) as info:
        PipelineParams.model_validate(params)
    assert where in str(info.value)


def _config_classes(cls: type, seen: dict[str, type]) -> dict[str, type]:
    """``cls`` and every config dataclass its fields hold, by name."""
    seen[cls.__name__] = cls
    for tp in typing.get_type_hints(cls).values():
        for inner in (tp, *typing.get_args(tp)):
            if dataclasses.is_dataclass(inner) and inner.__name__ not in seen:
                _config_classes(inner, seen)
    return seen


def test_every_range_a_config_class_checks_is_in_the_schema():
    """The server checks ranges from the schema; the dataclasses check the same ``RANGES``."""
    schema = PipelineParams.model_json_schema()
    checked = 0
    for name, cls in _config_classes(PipelineConfig, {}).items():
        for field, bounds in getattr(cls, "RANGES", {}).items():
            prop = schema["$defs"].get(name, schema)["properties"][field]
            spec = next((s for s in prop.get("anyOf", [prop]) if s.get("type") != "null"), prop)
            low = "exclusiveMinimum" if bounds.low_excluded else "minimum"
            high = "exclusiveMaximum" if bounds.high_excluded else "maximum"
            assert (spec.get(low), spec.get(high)) == (bounds.low, bounds.high), (name, field)
            checked += 1
    assert checked > 40


def test_only_what_is_set_overrides_the_defaults():
    params = PipelineParams.model_validate({"scheduler": {"drift_tolerance": 3.0}, "eval": {"slots": 2}})
    assert set_fields(params) == {"scheduler": {"drift_tolerance": 3.0}, "eval": {"slots": 2}}
    cfg = load_pipeline_config(params=set_fields(params))
    assert cfg.scheduler.drift_tolerance == 3.0 and cfg.scheduler.min_interval_steps == 25 and cfg.eval.slots == 2


def test_the_flows_parameter_schema_is_the_typed_form():
    from prefect.utilities.callables import parameter_schema

    from flows.train_and_evaluate import train_and_evaluate

    schema = parameter_schema(train_and_evaluate.fn).model_dump()
    assert schema["properties"]["params"]["description"].startswith("pipeline config sections")
    assert schema["definitions"]["EvalConfig"]["additionalProperties"] is False
    with pytest.raises(Exception, match=r"eval\.nprocs"):
        train_and_evaluate.validate_parameters({"params": {"eval": {"nprocs": 2}}})


def test_choice_fields_are_enums_and_evaluator_names_a_pattern_in_the_form():
    schema = PipelineParams.model_json_schema()["$defs"]
    assert schema["ModelConfig"]["properties"]["objective"]["enum"] == ["reward_model", "sft"]
    assert schema["SchedulerConfig"]["properties"]["policy"]["enum"] == ["adaptive", "fixed"]
    for bad, where in (
        ({"model": {"objective": "sfft"}}, "model.objective"),
        ({"eval": {"evaluator": "rm"}}, "eval.evaluator"),
    ):
        with pytest.raises(ValidationError) as info:
            PipelineParams.model_validate(bad)
        assert where in str(info.value)
    for good in ("generation,lm_loss", "reward_model", "tests.custom_evaluator:MarginOver"):
        PipelineParams.model_validate({"eval": {"evaluator": good}})


def test_global_step_is_refused_below_zero_in_evaluate_checkpoints_form():
    from prefect.utilities.callables import parameter_schema

    from flows.evaluate_checkpoint import evaluate_checkpoint

    assert parameter_schema(evaluate_checkpoint).properties["global_step"]["minimum"] == 0


def test_an_unedited_form_overrides_nothing():
    # What the Prefect UI sends for an untouched form: every checkbox left at None, nothing else.
    untouched = {
        "eval": {"warm_workers": None, "generation": {"greedy": None}},
        "train": {"save": {"eval_before_train": None}},
    }
    assert set_fields(PipelineParams.model_validate(untouched)) == {"eval": {"generation": {}}, "train": {"save": {}}}
    cfg = load_pipeline_config(params=set_fields(PipelineParams.model_validate(untouched)))
    assert cfg == load_pipeline_config()
    edited = {"eval": {"warm_workers": False}, "run_name": "mine"}
    assert set_fields(PipelineParams.model_validate(edited)) == edited
    warm = PipelineParams.model_json_schema()["$defs"]["EvalConfig"]["properties"]["warm_workers"]
    assert warm["default"] is None and warm["description"].endswith("Default: true.")
