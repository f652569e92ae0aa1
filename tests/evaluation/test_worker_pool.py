"""Warm evaluation workers: one torchrun job (gloo) serving several evaluations."""

import json
from pathlib import Path

import pytest

from areal_eval.checkpoints.manifest import Manifest
from areal_eval.evaluation.jobs import EvalConfig, EvaluationFailed, run_evaluation_job
from areal_eval.evaluation.worker_pool import WarmEvalWorkers
from tests.helpers import live_processes, single_process_metrics

pytestmark = pytest.mark.integration


def test_one_job_serves_several_evaluations_with_the_same_results(trained_run, tmp_path):
    cfg, run = trained_run
    events = Manifest(run.manifest).events()
    eval_cfg = EvalConfig(nproc=2, batch_size=16)
    with WarmEvalWorkers(2, tmp_path / "pool") as workers:
        warm = [run_evaluation_job(e, run.valid_data, eval_cfg, tmp_path / "warm", workers=workers) for e in events]
        assert workers.started_jobs == 1  # the same ranks evaluated every checkpoint
    assert live_processes(str(tmp_path / "pool")) == [] and workers.job is None
    for event, result in zip(events, warm, strict=True):
        assert result.metrics == pytest.approx(single_process_metrics(event, run.valid_data), abs=1e-6), (
            event.global_step
        )


def test_a_dead_rank_fails_that_evaluation_and_the_next_starts_fresh_ranks(trained_run, tmp_path, monkeypatch):
    cfg, run = trained_run
    event = Manifest(run.manifest).events()[-1]
    monkeypatch.setenv("AREAL_EVAL_INJECT_FAULT", f"1:exit:{tmp_path / 'fired'}")  # rank 1 dies once
    eval_cfg = EvalConfig(nproc=2, batch_size=16, collective_timeout_s=20)
    with WarmEvalWorkers(2, tmp_path / "pool", collective_timeout_s=20) as workers:
        with pytest.raises(EvaluationFailed, match=r"(?s)step 12.*rank 1 \(local_rank: 1\) exit code 17"):
            run_evaluation_job(event, run.valid_data, eval_cfg, tmp_path / "out", workers=workers)
        result = run_evaluation_job(event, run.valid_data, eval_cfg, tmp_path / "out", workers=workers)
        assert result.metrics["n_pairs"] == 101 and workers.started_jobs == 2
    assert live_processes(str(tmp_path / "pool")) == []


def test_a_job_whose_spec_is_bad_is_recorded_with_the_field_named(tmp_path):
    out = tmp_path / "result.json"
    with WarmEvalWorkers(2, tmp_path / "pool", collective_timeout_s=20) as workers:
        code, log = workers.run({"out": str(out), "checkpoint": "/c", "no_such_field": 1}, 120)
    assert code != 0
    error = json.loads(out.read_text())["error"]
    assert "ConfigError: job " in error and "unknown config field no_such_field" in error
    assert "evaluation failed (job " in log.read_text()
    assert live_processes(str(tmp_path / "pool")) == []


def test_two_slots_evaluate_two_checkpoints_at_once_on_their_own_ranks(trained_run, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from areal_eval.evaluation.worker_pool import WarmWorkerGroups

    cfg, run = trained_run
    events = Manifest(run.manifest).events()[-2:]
    eval_cfg = EvalConfig(nproc=2, batch_size=16)

    def evaluate(event):
        with groups.lease() as group:
            return run_evaluation_job(event, run.valid_data, eval_cfg, tmp_path / "out", workers=group), group

    with WarmWorkerGroups(2, 2, tmp_path / "pool") as groups, ThreadPoolExecutor(2) as pool:
        results = list(pool.map(evaluate, events))
        assert groups.started_jobs == 2 and results[0][1] is not results[1][1]
    assert live_processes(str(tmp_path / "pool")) == []
    for event, (result, _) in zip(events, results, strict=True):
        assert result.global_step == event.global_step
        assert result.metrics == pytest.approx(single_process_metrics(event, run.valid_data), abs=1e-6)


def test_a_warm_rank_hands_each_jobs_gpu_memory_back_before_the_next(tmp_path, monkeypatch):
    """Torch's allocator would keep an idle rank's last model and activations on the GPU, where a
    training sharing the device needs them: ``serve`` empties it after every job."""
    from areal_eval import jsonl
    from areal_eval.evaluation import worker
    from areal_eval.evaluation.job_spec import EvalJobSpec, to_json

    events = []
    monkeypatch.setattr(worker, "run_job", lambda spec, started_at: events.append(("job", Path(spec.out).name)))
    monkeypatch.setattr(worker.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(worker.torch.cuda, "empty_cache", lambda: events.append(("emptied",)))
    inbox = tmp_path / "inbox"
    for name in ("1-a", "2-b"):
        spec = EvalJobSpec(checkpoint="/c", data="/d", out=str(tmp_path / f"{name}.json"), files=[])
        jsonl.write_json(inbox / f"{name}.json", {"spec": to_json(spec)})
    jsonl.write_json(inbox / "stop.json", {"spec": None})
    worker.serve(inbox)
    assert events == [("job", "1-a.json"), ("emptied",), ("job", "2-b.json"), ("emptied",)]
