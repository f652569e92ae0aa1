"""The evaluator registry: a user's own evaluator by its import path, on the workers."""

from pathlib import Path

import pytest

from areal_eval.checkpoints.manifest import CheckpointEvent, describe_files
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


def printed_evaluator(directory: Path) -> Path:
    """The evaluator of docs/evaluators.md ("Adding an evaluator"), saved as printed there."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "evaluators.md").read_text()
    section = docs.split("## Adding an evaluator", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    (directory / "answer_tokens.py").write_text(code)
    return directory


def test_the_evaluator_the_docs_print_runs_on_two_ranks_as_in_one_process(causal_checkpoint, tmp_path, monkeypatch):
    import sys

    from tests.helpers import causal_metrics

    checkpoint, prompts = causal_checkpoint
    where = printed_evaluator(tmp_path)
    monkeypatch.setenv("PYTHONPATH", f"{where}:{Path(__file__).resolve().parents[2]}")
    monkeypatch.syspath_prepend(str(where))
    sys.modules.pop("answer_tokens", None)
    one_process = causal_metrics(checkpoint, prompts, evaluator="answer_tokens:AnswerTokens")
    event = CheckpointEvent("docs", str(checkpoint), 0, 1, 1, 0.0, {}, describe_files(checkpoint))
    from areal_eval.evaluation.lm_loss import LMLossConfig

    cfg = EvalConfig(
        nproc=2, evaluator="answer_tokens:AnswerTokens,lm_loss", lm_loss=LMLossConfig(completion_field="answer")
    )
    two_ranks = run_evaluation_job(event, prompts, cfg, tmp_path / "eval").metrics
    assert two_ranks["answer_tokens/n_tokens"] == one_process["n_tokens"] > 41  # every answer token once
    assert two_ranks["answer_tokens/token_accuracy"] == pytest.approx(one_process["token_accuracy"], abs=1e-12)
    assert 0.5 < one_process["token_accuracy"] <= 1.0  # the test model has learned the answers' form
