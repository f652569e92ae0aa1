"""The evaluator registry: a user's own evaluator by its import path, on the workers."""

from pathlib import Path

import pytest

from areal_eval.evaluation.evaluators import BaseEvaluator, make_evaluator
from areal_eval.evaluation.job_spec import EvaluatorSettings
from areal_eval.evaluation.jobs import EvalConfig, run_evaluation_job

pytestmark = pytest.mark.integration


def test_users_add_evaluators_by_subclassing(final_checkpoint, tmp_path, monkeypatch):
    run, event = final_checkpoint
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    cfg = EvalConfig(nproc=2, evaluator="tests.custom_evaluator:MarginOver")
    result = run_evaluation_job(event, run.valid_data, cfg, tmp_path)
    assert set(result.metrics) == {"margin_over_0.1", "n_pairs"} and result.metrics["n_pairs"] == 101
    assert isinstance(make_evaluator("tests.custom_evaluator:MarginOver", EvaluatorSettings()), BaseEvaluator)
    with pytest.raises(ValueError, match="unknown evaluator"):
        make_evaluator("nope", EvaluatorSettings())
