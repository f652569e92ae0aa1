"""The pre-flight check in a process of its own, as a flow process (no transformers) runs it."""

import json
import sys

import pytest

from areal_eval.checkpoints.manifest import CheckpointEvent, describe_files
from areal_eval.evaluation.generation import GenerationConfig
from areal_eval.evaluation.job_spec import EvalJobSpec, write_spec
from areal_eval.evaluation.jobs import EvalConfig, run_evaluation_job
from areal_eval.evaluation.preflight import run_preflight
from areal_eval.launchers.local import stay_offline

pytestmark = pytest.mark.integration


def test_in_a_process_of_its_own_a_bad_setting_is_refused_in_one_line_and_good_data_passes(
    causal_checkpoint, tmp_path, monkeypatch
):
    checkpoint, prompts = causal_checkpoint
    monkeypatch.delitem(sys.modules, "transformers")  # as in a flow's process: the check starts one of its own
    spec = dict(
        checkpoint=str(checkpoint), data=str(prompts), out=str(tmp_path / "o.json"), files=[], evaluator="generation"
    )
    env = stay_offline(dict(__import__("os").environ))
    templated = write_spec(tmp_path / "t.json", EvalJobSpec(**spec, generation=GenerationConfig(chat_template=True)))
    refused = run_preflight(templated, env, timeout_s=120)
    assert refused == "ConfigError: eval.generation.chat_template: the tokenizer has no chat template"
    assert run_preflight(write_spec(tmp_path / "ok.json", EvalJobSpec(**spec)), env, timeout_s=120) is None
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "Q: 1 + 1", "answer": "2"}) + "\n" + json.dumps({"prompt": "Q"}) + "\n")
    refused = run_preflight(write_spec(tmp_path / "bad.json", EvalJobSpec(**{**spec, "data": str(bad)})), env, 120)
    assert refused.startswith(f"DataError: {bad}:2: no 'answer'")


def test_settings_the_checkpoint_cannot_honour_are_refused_before_any_worker_starts(causal_checkpoint, tmp_path):
    from areal_eval.evaluation.jobs import EvaluationConfigError

    checkpoint, prompts = causal_checkpoint
    event = CheckpointEvent("causal", str(checkpoint), 0, 0, 150, 0.0, {}, describe_files(checkpoint))
    cfg = EvalConfig(nproc=1, evaluator="generation", generation=GenerationConfig(chat_template=True))
    refused = "refused before any worker started: ConfigError: .*no chat template"
    with pytest.raises(EvaluationConfigError, match=refused):
        run_evaluation_job(event, prompts, cfg, tmp_path)
    assert not list(tmp_path.glob("*.log"))
