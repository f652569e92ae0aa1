"""Feedback latency of the real pipeline: p50/p99 from a durable checkpoint to feedback.

    .venv/bin/python bench/feedback_latency.py [--steps 750]

Runs the train-and-evaluate flow (Prefect's local API, MLflow on SQLite, torchrun training and
evaluation on this machine), then reads the timestamps the run left behind:

* durable -> decision: manifest ``wall_time`` (set once files are durable) to the ledger's first
  record for that checkpoint;
* decision -> evaluation workers started: to the moment rank 0 entered its main (includes waiting
  for the evaluation in flight); and launch -> started, the workers' own start-up;
* durable -> metrics visible in MLflow: to the timestamp of the MLflow metric.

The end-of-run refinement (skipped neighbours of the best, looked at once the final checkpoint
is in) is not feedback on arrival: those evaluations are counted (``refined``) but left out.

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from common import emit, percentile, prepared_run  # noqa: F401 (sets up sys.path and env)


def stats(values: list[float]) -> dict:
    ms = [v * 1000 for v in values]
    return {"p50_ms": round(percentile(ms, 0.5), 1), "p99_ms": round(percentile(ms, 0.99), 1), "n": len(ms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=750)
    args = parser.parse_args()

    from areal_eval.checkpoints.manifest import Manifest
    from areal_eval.runs.directory import RunDir
    from areal_eval.tracking import Tracker, TrackingConfig
    from flows.train_and_evaluate import train_and_evaluate

    work = Path(tempfile.mkdtemp(prefix="bench-latency-"))
    params = {
        "run_name": "latency",
        "work_dir": str(work),
        "train": {"max_steps": args.steps},
        "tracking": {"tracking_uri": f"sqlite:///{work / 'mlflow.db'}"},
    }
    summary = train_and_evaluate(params=params)
    run = RunDir(work / "latency")
    durable = {e.global_step: e.wall_time for e in Manifest(run.manifest).events()}
    decided: dict[int, float] = {}
    refined = set()
    for line in run.ledger.read_text().splitlines():
        row = json.loads(line)
        decided.setdefault(row["step"], row["time"])
        if row["status"] == "scheduled" and row["reason"].startswith("refine"):
            refined.add(row["step"])
    results = {int(p.stem.split("_")[-1]): json.loads(p.read_text()) for p in run.evals.glob("global_step_*[0-9].json")}
    results = {s: r for s, r in results.items() if s not in refined}
    tracker = Tracker(TrackingConfig(tracking_uri=summary["tracking_uri"], experiment="areal-eval"))
    history = tracker.client.get_metric_history(summary["mlflow_run_id"], "eval/accuracy")
    visible = {m.step: m.timestamp / 1000 for m in history if m.step not in refined}
    emit(
        {
            "benchmark": "feedback_latency",
            "checkpoints": len(durable),
            "evaluated": len(history),
            "refined": len(refined),
            "durable_to_decision": stats([decided[s] - t for s, t in durable.items() if s in decided]),
            "decision_to_workers_started": stats(
                [r["started_at"] - decided[s] for s, r in results.items() if "started_at" in r]
            ),
            "launch_to_workers_started": stats(
                [r["started_at"] - r["launched_at"] for r in results.values() if "started_at" in r]
            ),
            "durable_to_mlflow": stats([visible[s] - durable[s] for s in visible]),
        }
    )


if __name__ == "__main__":
    main()
