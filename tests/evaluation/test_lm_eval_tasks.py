"""The lm_eval evaluator against lm-evaluation-harness's own single-process simple_evaluate."""

import pytest

from areal_eval.evaluation.lm_eval_tasks import LMEvalConfig, LMEvalEvaluator, run_tasks
from areal_eval.models import causal_lm
from tests.helpers import causal_metrics, harness_reference


def test_one_rank_equals_the_harness_and_names_metrics_task_slash_metric(causal_checkpoint, arith_task):
    checkpoint, prompts = causal_checkpoint
    reference = harness_reference(checkpoint, arith_task)
    assert set(reference) == {"arith_mc/acc", "arith_mc/acc_stderr", "arith_mc/acc_norm", "arith_mc/acc_norm_stderr"}
    assert 0 < reference["arith_mc/acc"] < 1 and reference["arith_mc/acc_stderr"] > 0
    ours = causal_metrics(checkpoint, prompts, "lm_eval", lm_eval=arith_task)
    assert ours == pytest.approx(reference, abs=1e-6)
    model, tokenizer = causal_lm.load_shared(checkpoint)
    metrics, rows = run_tasks(model, tokenizer, arith_task, samples=True)
    assert metrics == pytest.approx(reference, abs=1e-6)
    # Every document's scores: their mean is the harness's metric.
    assert len({r["doc_id"] for r in rows}) == len(rows) and {r["task"] for r in rows} == {"arith_mc"}
    for name in ("acc", "acc_norm"):
        assert sum(r[name] for r in rows) / len(rows) == pytest.approx(reference[f"arith_mc/{name}"], abs=1e-9)
    assert run_tasks(model, tokenizer, arith_task)[1] == []  # not asked for


def test_tasks_are_required_and_a_missing_task_directory_is_named(tmp_path):
    from areal_eval.config.parsing import ConfigError, FieldError
    from areal_eval.pipeline.config import load_pipeline_config

    with pytest.raises(ConfigError, match="eval.lm_eval.tasks: name at least one"):
        load_pipeline_config(overrides=["eval.evaluator=lm_eval"])

    with pytest.raises(FieldError, match="eval.lm_eval.tasks"):
        LMEvalEvaluator(LMEvalConfig())
    with pytest.raises(FieldError, match=f"{tmp_path / 'none'}: no such directory"):
        LMEvalEvaluator(LMEvalConfig(tasks=["x"], include_path=str(tmp_path / "none")))
