"""Two evaluation slots against one, when evaluation is slower than checkpointing.

    .venv/bin/python bench/slots.py [--checkpoints 60] [--every-s 0.1] [--rounds 2]

Trains the demo's reward model once (2 DDP ranks, tiny size), then a publisher process announces
``--checkpoints`` checkpoints (the trained ones in turn, each published with ``publish_checkpoint``:
sizes, sha256, manifest) every ``--every-s`` seconds. The library's follow loop evaluates them
with the real planner (fixed policy: every checkpoint wanted, coalescing when behind) on warm
torchrun worker groups (one rank each, a group per slot) and logs each result to MLflow (SQLite).
Rounds alternate 1 and 2 slots, so both see the same machine. Reports, per slot count,
checkpoints evaluated and superseded and durable->MLflow p50/p99; prints one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import ProcessJob, emit, percentile, trained_tiny_run


def publish(manifest: Path, checkpoints: list[str], count: int, every_s: float, durable: dict) -> None:
    from areal_eval.checkpoints.publisher import publish_checkpoint

    for i in range(count):
        started = time.monotonic()
        publish_checkpoint(
            checkpoints[i % len(checkpoints)], manifest, "slots", global_step=10 * i, final=i == count - 1
        )
        durable[10 * i] = time.time()
        time.sleep(max(0.0, every_s - (time.monotonic() - started)))


class TimedIO:
    """Evaluations on the worker groups; results to MLflow, the landing time of each noted."""

    def __init__(self, cfg, run, groups, tracker, mlflow_run_id: str):
        self.cfg, self.run, self.groups, self.tracker, self.mlflow_run_id = cfg, run, groups, tracker, mlflow_run_id
        self.pool = ThreadPoolExecutor(4)
        self.landed: dict[int, float] = {}

    def _evaluate(self, event):
        from areal_eval.evaluation.jobs import run_evaluation_job

        with self.groups.lease() as group:
            return run_evaluation_job(
                event,
                self.run.valid_data,
                self.cfg.eval,
                self.run.evals,
                max_length=self.cfg.model.max_length,
                workers=group,
            )

    def submit(self, event, reason):
        return self.pool.submit(self._evaluate, event)

    def log_result(self, result, reason):
        self.tracker.log_evaluation(self.mlflow_run_id, result.global_step, result.metrics)
        self.landed[result.global_step] = time.time()

    def announce(self, event):
        pass

    def send_alert(self, alert):
        pass

    def log_training(self, rows):
        pass

    def delete_checkpoints(self, events):
        pass

    def info(self, message):
        pass

    def warn(self, message):
        print("warning:", message)


def warm_up(groups, cfg, run, slots: int) -> None:
    from areal_eval.checkpoints.manifest import Manifest
    from areal_eval.evaluation.jobs import run_evaluation_job

    event = Manifest(run.manifest).events()[0]
    leases = [groups.lease() for _ in range(slots)]
    for i, lease in enumerate(leases):
        with lease as group:
            run_evaluation_job(
                event,
                run.valid_data,
                cfg.eval,
                run.evals / f"warm-up-{i}",
                max_length=cfg.model.max_length,
                workers=group,
            )


def run_round(work: Path, trained, slots: int, args) -> dict:
    from areal_eval.alerts import AlertEngine, AlertsConfig
    from areal_eval.checkpoints.manifest import Manifest
    from areal_eval.evaluation.worker_pool import WarmWorkerGroups
    from areal_eval.lifecycle.follow_loop import FollowLoop, LoopConfig
    from areal_eval.lifecycle.planner import EvaluationPlanner
    from areal_eval.runs.ledger import Ledger
    from areal_eval.scheduling.policy import SchedulerConfig
    from areal_eval.tracking import Tracker, TrackingConfig

    cfg, run = trained
    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, nproc=1, slots=slots))
    work.mkdir(parents=True)
    manifest = work / "manifest.jsonl"
    checkpoints = [e.uri for e in Manifest(run.manifest).events()]
    tracker = Tracker(TrackingConfig(tracking_uri=f"sqlite:///{work / 'mlflow.db'}", experiment="slots"))
    mlflow_run_id = tracker.start_run(f"slots-{slots}", {"slots": slots})
    durable = multiprocessing.Manager().dict()
    publisher = multiprocessing.Process(
        target=publish, args=(manifest, checkpoints, args.checkpoints, args.every_s, durable)
    )
    planner = EvaluationPlanner(
        SchedulerConfig(policy="fixed", fixed_interval_steps=1, queue_capacity=1), Ledger(work / "ledger.jsonl")
    )
    with WarmWorkerGroups(slots, 1, run.evals / f"slots-{slots}-{work.name}") as groups:
        io = TimedIO(cfg, run, groups, tracker, mlflow_run_id)
        warm_up(groups, cfg, run, slots)  # every group's ranks up before the clock runs
        publisher.start()
        started = time.monotonic()
        ledger = FollowLoop(
            planner,
            Manifest(manifest),
            work / "train_log.jsonl",
            AlertEngine(AlertsConfig()),
            io,
            LoopConfig(poll_interval_s=0.05, slots=slots),
            ProcessJob(publisher),
        ).run()
        elapsed = time.monotonic() - started
        io.pool.shutdown()
    publisher.join()
    latency = [io.landed[s] - durable[s] for s in io.landed]
    counts = ledger.counts()
    return {
        "slots": slots,
        "seconds": round(elapsed, 1),
        "evaluated": counts.get("evaluated", 0),
        "superseded": counts.get("superseded", 0),
        "failed": counts.get("failed", 0),
        "durable_to_mlflow_p50_s": round(percentile(latency, 0.5), 2),
        "durable_to_mlflow_p99_s": round(percentile(latency, 0.99), 2),
        "mlflow_steps_match_ledger": sorted(tracker.eval_steps(mlflow_run_id))
        == sorted(e.step for e in ledger.entries() if e.status == "evaluated"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=int, default=60)
    parser.add_argument("--every-s", type=float, default=0.1, help="seconds between published checkpoints")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of (1 slot, 2 slots)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-slots-"))
    cfg, run = trained_tiny_run(work)
    rounds = [
        run_round(work / f"round-{i}-slots-{slots}", (cfg, run), slots, args)
        for i in range(args.rounds)
        for slots in (1, 2)
    ]
    for r in rounds:
        print(r)
    by = {s: [r for r in rounds if r["slots"] == s] for s in (1, 2)}
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    emit(
        {
            "benchmark": "slots",
            "checkpoints": args.checkpoints,
            "every_s": args.every_s,
            "rounds": rounds,
            "superseded_2_vs_1": round(mean(by[2], "superseded") / max(mean(by[1], "superseded"), 1e-9), 2),
            "evaluated_2_vs_1": round(mean(by[2], "evaluated") / mean(by[1], "evaluated"), 2),
            "p50_2_vs_1": round(mean(by[2], "durable_to_mlflow_p50_s") / mean(by[1], "durable_to_mlflow_p50_s"), 2),
            "p99_2_vs_1": round(mean(by[2], "durable_to_mlflow_p99_s") / mean(by[1], "durable_to_mlflow_p99_s"), 2),
        }
    )


if __name__ == "__main__":
    main()
