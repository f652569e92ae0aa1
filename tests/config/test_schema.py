"""The config as the typed parameter of the flows: a described form, strict validation."""

import pytest
from pydantic import ValidationError

from areal_eval.config.pipeline import load_pipeline_config
from areal_eval.config.schema import PipelineParams, field_docs, set_fields
from areal_eval.evaluation.jobs import EvalConfig


def test_every_field_has_its_docstring_as_description():
    assert field_docs(EvalConfig)["nproc"].startswith("Evaluation ranks per node")
    schema = PipelineParams.model_json_schema()
    eval_fields = schema["$defs"]["EvalConfig"]["properties"]
    assert all(field.get("description") for field in eval_fields.values())
    assert schema["properties"]["scheduler"]["default"]["min_interval_steps"] == 25  # the pipeline's default


@pytest.mark.parametrize(
    "params, where",
    [
        ({"eval": {"nproc": True}}, "eval.nproc"),  # a bool is not an int
        ({"eval": {"nproc": "2"}}, "eval.nproc"),
        ({"eval": {"nprocs": 2}}, "eval.nprocs"),  # unknown, refused by its dotted path
        ({"alerts": {"rules": [{"name": "x", "kind": "sometimes"}]}}, "alerts.rules.0.kind"),
    ],
)
def test_bad_params_are_refused_naming_the_field(params, where):
    with pytest.raises(ValidationError) as info:
        PipelineParams.model_validate(params)
    assert where in str(info.value)


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
