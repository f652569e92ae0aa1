"""eval.dtype: every evaluator loads and runs the model in it; metrics are summed in float64.

The tolerance bf16 is held to (docs/evaluators.md): loss and perplexity within 1% of float32,
greedy accuracy within 5 points and mean answer length within 5%. Counts do not move."""

import pytest
import torch

from areal_eval.evaluation.evaluators import make_evaluator
from areal_eval.evaluation.job_spec import EvaluatorSettings
from areal_eval.evaluation.lm_loss import LMLossConfig
from areal_eval.models import causal_lm
from tests.helpers import causal_metrics

ANSWER_COLUMN = LMLossConfig(completion_field="answer")


@pytest.mark.parametrize("evaluator", ["generation", "lm_loss"])
def test_each_evaluator_runs_the_model_in_the_dtype_asked(causal_checkpoint, evaluator):
    checkpoint, prompts = causal_checkpoint
    for dtype, expected in (("bfloat16", torch.bfloat16), ("auto", torch.float32), ("float16", torch.float16)):
        loaded = make_evaluator(evaluator, EvaluatorSettings(dtype=dtype, lm_loss=ANSWER_COLUMN))
        loaded.load(checkpoint, prompts)
        assert next(loaded.model.parameters()).dtype == expected, dtype


def test_bf16_metrics_stay_within_the_stated_tolerance_of_float32(causal_checkpoint):
    checkpoint, prompts = causal_checkpoint
    for evaluator in ("generation", "lm_loss"):
        full, half = (
            causal_metrics(checkpoint, prompts, evaluator, dtype=dtype, lm_loss=ANSWER_COLUMN)
            for dtype in ("float32", "bfloat16")
        )
        counts = [m for m in full if m.startswith(("n_", "truncated"))]
        assert {m: half[m] for m in counts} == {m: full[m] for m in counts}
        if evaluator == "lm_loss":
            assert half["loss"] == pytest.approx(full["loss"], rel=0.01)
            assert half["perplexity"] == pytest.approx(full["perplexity"], rel=0.01)
        else:
            assert abs(half["accuracy"] - full["accuracy"]) <= 0.05
            assert half["response_length"] == pytest.approx(full["response_length"], rel=0.05)


def test_auto_is_the_dtype_the_checkpoint_records(causal_checkpoint, tmp_path):
    checkpoint, _ = causal_checkpoint
    model = causal_lm.load_model(checkpoint, dtype="bfloat16")
    model.save_pretrained(tmp_path)
    assert next(causal_lm.load_model(tmp_path, dtype="auto").parameters()).dtype == torch.bfloat16
    assert next(causal_lm.load_model(tmp_path, dtype="float32").parameters()).dtype == torch.float32
