"""Probes (``scheduler.probe_fraction``) on the pipeline's two paths: the in-flow loop of
``train-and-evaluate`` and ``evaluate-checkpoint`` as triggers run it, each on a trained run's
checkpoints 0, 4, 8 and the final 12, with real torchrun workers, the Prefect test API and MLflow
on SQLite."""

import dataclasses
import json

from areal_eval.runs.ledger import Ledger
from areal_eval.tracking import PROBE_PREFIX
from tests.helpers import copy_trained_run, mlflow_run, sqlite_mlflow_uri

SUBSET_PAIRS = 30
"""The probe subset of the trained run's 101 validation pairs at ``probe_fraction`` 0.3."""


def probing(cfg, tmp_path, escalate_stderrs: float):
    """``cfg`` with fixed:100 (only the first and the final checkpoint are due), probes on a
    fraction 0.3, no refinement and no coalescing, tracked in a store of the test's own."""
    scheduler = dataclasses.replace(
        cfg.scheduler,
        policy="fixed",
        fixed_interval_steps=100,
        refine_stderrs=None,
        coalesce=False,  # every probe runs, however far behind evaluation falls
        probe_fraction=0.3,
        probe_escalate_stderrs=escalate_stderrs,
    )
    tracking = dataclasses.replace(cfg.tracking, tracking_uri=sqlite_mlflow_uri(tmp_path))
    return dataclasses.replace(cfg, work_dir=str(tmp_path), scheduler=scheduler, tracking=tracking)


def probe_and_eval_steps(cfg) -> tuple[list[int], list[int], dict]:
    """The tested run's steps of ``eval_probe/accuracy`` and ``eval/accuracy``, and its probes'
    ``n_pairs`` by step (the dispatched copy has an MLflow run of its own)."""
    tracker, runs = mlflow_run(cfg)
    [run] = [r for r in runs if r.data.tags.get("areal.run_id") != "dispatched"]
    history = {key: tracker.client.get_metric_history(run.info.run_id, key) for key in run.data.metrics}
    steps = {key: sorted(m.step for m in points) for key, points in history.items()}
    pairs = {m.step: m.value for m in history["eval_probe/n_pairs"]}
    return steps["eval_probe/accuracy"], steps["eval/accuracy"], pairs


def test_the_flow_probes_what_it_skips_and_logs_probes_apart_from_results(prefect_server, trained_run, tmp_path):
    from prefect import flow

    from flows.train_and_evaluate import follow_and_evaluate
    from tasks.mlflow_logging import start_tracking

    cfg, original = trained_run
    cfg = probing(cfg, tmp_path, escalate_stderrs=1e9)  # no probe can move that far: every one is held
    run = copy_trained_run(original, cfg.run_root)
    mlflow_run_id = start_tracking(cfg, run)

    @flow(name="evaluate-existing-run")
    def evaluate_existing():
        return follow_and_evaluate(cfg, run, mlflow_run_id, training=None)

    ledger = evaluate_existing()
    entries = {e.step: e for e in ledger.entries()}
    assert [(s, e.status, e.probe) for s, e in entries.items()] == [
        (0, "evaluated", None),
        (4, "skipped", "held"),
        (8, "skipped", "held"),
        (12, "evaluated", None),
    ]
    assert (
        entries[4].reason.startswith("fixed interval: 4 < 100 steps; probe ") and "<= 1e+09 stderr" in entries[4].reason
    )
    assert all(e.delivered and e.probe_metrics["n_pairs"] == SUBSET_PAIRS for e in entries.values())
    # Probes at their steps as eval_probe/*, never as results; full results carry their subset part.
    probe_steps, eval_steps, pairs = probe_and_eval_steps(cfg)
    assert probe_steps == [0, 4, 8, 12] and eval_steps == [0, 12]
    assert set(pairs.values()) == {SUBSET_PAIRS}
    assert ledger.counts() == {"evaluated": 2, "skipped": 2} and ledger.probe_counts() == {"probed": 2, "escalated": 0}


def test_triggered_runs_probe_and_escalate_as_the_flow_does(prefect_server, trained_run, tmp_path):
    from flows.evaluate_checkpoint import evaluate_checkpoint
    from tasks.evaluation import serve_warm_workers

    cfg, original = trained_run
    cfg = probing(cfg, tmp_path, escalate_stderrs=0.0)  # any change escalates
    run = copy_trained_run(original, tmp_path / "triggered")
    params = json.loads(json.dumps(dataclasses.asdict(cfg)))
    dispatched = copy_trained_run(original, tmp_path / "dispatched", run_id="dispatched")
    with serve_warm_workers(cfg, tmp_path / "warm"):  # one torchrun job for every evaluation here
        results = {s: evaluate_checkpoint(s, str(run.manifest), params=params) for s in (0, 4, 8, 12)}
        # As train-and-evaluate dispatches a probe to the evaluation pool: evaluated and logged only.
        sent = evaluate_checkpoint(4, str(dispatched.manifest), params=params, dispatched=True, probe=True)
    tracker, _ = mlflow_run(cfg)
    logged = tracker.client.get_run(tracker.find_run("dispatched")).data.metrics
    assert not sent["evaluated"] and sent["metrics"] == {} and not any(k.startswith("eval/") for k in logged)
    assert tracker.step_metrics(tracker.find_run("dispatched"), 4, logged, PROBE_PREFIX)["n_pairs"] == SUBSET_PAIRS
    entries = {e.step: e for e in Ledger(run.ledger).entries()}
    assert [(s, e.status) for s, e in entries.items() if not e.probe] == [(0, "evaluated"), (12, "evaluated")]
    moved = {s: entries[s].probe_metrics["accuracy"] != entries[0].probe_metrics["accuracy"] for s in (4, 8)}
    assert any(moved.values())  # the trained run's step 8 moved on the subset
    for step in (4, 8):
        assert results[step]["probe_metrics"]["n_pairs"] == SUBSET_PAIRS
        if moved[step]:  # escalated and evaluated in full by the same flow run
            assert (entries[step].status, entries[step].probe) == ("evaluated", "escalated")
            assert results[step]["evaluated"] and results[step]["metrics"]["n_pairs"] == 101
            assert results[step]["reason"].startswith("escalated: probe ") and "> 0 stderr" in results[step]["reason"]
        else:  # the same value on the subset: within 0 stderr
            assert (entries[step].status, entries[step].probe) == ("skipped", "held")
            assert not results[step]["evaluated"] and "<= 0 stderr" in results[step]["reason"]
    probe_steps, eval_steps, pairs = probe_and_eval_steps(cfg)
    assert probe_steps == [0, 4, 8, 12] and set(pairs.values()) == {SUBSET_PAIRS}  # each once
    assert eval_steps == sorted([0, 12] + [s for s in (4, 8) if moved[s]])
    tags = tracker.client.get_run(tracker.find_run(run.run_id)).data.tags  # the run that found the run over ended it
    assert (tags["checkpoints.probed"], tags["checkpoints.escalated"]) == ("2", str(sum(moved.values())))
