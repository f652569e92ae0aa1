"""Training overhead of the evaluation pipeline, measured side by side.

    .venv/bin/python bench/training_overhead.py [--steps 300] [--rounds 2]

Runs the same training job (2 DDP ranks, checkpoint every 25 steps) three ways, alternating:
pipeline off; pipeline on; pipeline on with the evaluation workers at ``eval.nice=19`` (on a
machine where they share CPUs with training, they then take only what training leaves). "On"
is the pipeline's own loop (follow the manifest, decide, evaluate on 2 separate torchrun ranks,
one at a time) without Prefect, so the numbers are the pipeline's. Reports training samples/s
each way, and the time the training loop was blocked by checkpointing (a CPU snapshot; writing,
hashing and announcing happen in a background thread) as a share of training time. Prints one
JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import threading
from pathlib import Path

from common import emit, median, prepared_run


def run_training(cfg, run, with_pipeline: bool, nice: int = 0) -> dict:
    from areal_eval.checkpoints.manifest import Manifest
    from areal_eval.evaluation.jobs import run_evaluation_job
    from areal_eval.launchers.local import TorchrunJob
    from areal_eval.lifecycle.followers import ManifestFollower
    from areal_eval.lifecycle.planner import EvaluationPlanner
    from areal_eval.runs.ledger import Ledger

    for stale in (run.manifest, run.train_log, run.ledger):
        stale.unlink(missing_ok=True)
    job = TorchrunJob("areal_eval.train", ["--config", str(run.train_config)], cfg.train.nproc, run.logs / "train.log")
    evaluated = 0
    if with_pipeline:
        planner = EvaluationPlanner(cfg.scheduler, Ledger(run.ledger))
        follower = ManifestFollower(Manifest(run.manifest))
        busy: threading.Thread | None = None
        final = False
        while not (final and busy is None and not planner.waiting):
            for event in follower.poll():
                planner.offer(event)
                final |= event.final
            if busy is not None and not busy.is_alive():
                busy, evaluated = None, evaluated + 1
            if busy is None and (event := planner.next()):
                eval_cfg = dataclasses.replace(cfg.eval, nice=nice)
                busy = threading.Thread(target=run_evaluation_job, args=(event, run.valid_data, eval_cfg, run.evals))
                busy.start()
            follower.wait(0.2)
    job.wait(900)
    job.raise_for_status("training")
    done = json.loads(run.train_log.read_text().splitlines()[-1])
    steps = max(json.loads(line)["step"] for line in run.train_log.read_text().splitlines())
    samples = steps * cfg.train.batch_size * cfg.train.nproc
    return {
        "samples_per_s": samples / done["train_s"],
        "blocked_share": done["blocked_s"] / done["train_s"],
        "checkpoints": len(Manifest(run.manifest).events()),
        "evaluated": evaluated,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    cfg, run = prepared_run("overhead", work, train={"max_steps": args.steps})
    off, on, on_nice = [], [], []
    for _ in range(args.rounds):  # alternate: this machine is noisy
        off.append(run_training(cfg, run, with_pipeline=False))
        on.append(run_training(cfg, run, with_pipeline=True))
        on_nice.append(run_training(cfg, run, with_pipeline=True, nice=19))
    emit(
        {
            "benchmark": "training_overhead",
            "steps": args.steps,
            "rounds": args.rounds,
            "samples_per_s_off": round(median(r["samples_per_s"] for r in off), 1),
            "samples_per_s_on": round(median(r["samples_per_s"] for r in on), 1),
            "throughput_ratio_on_off": round(
                median(r["samples_per_s"] for r in on) / median(r["samples_per_s"] for r in off), 3
            ),
            "samples_per_s_on_eval_nice19": round(median(r["samples_per_s"] for r in on_nice), 1),
            "throughput_ratio_on_nice19_off": round(
                median(r["samples_per_s"] for r in on_nice) / median(r["samples_per_s"] for r in off), 3
            ),
            "blocked_share_on": round(max(r["blocked_share"] for r in on + on_nice), 5),
            "checkpoints_per_run": on[0]["checkpoints"],
            "evaluated_per_run": [r["evaluated"] for r in on],
            "evaluated_per_run_nice19": [r["evaluated"] for r in on_nice],
        }
    )


if __name__ == "__main__":
    main()
