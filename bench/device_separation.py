"""Training throughput with evaluation on cores of its own against evaluation on training's.

    .venv/bin/python bench/device_separation.py [--steps 200] [--rounds 2]

One training rank pinned to core A (``train.devices: [A]``) while one evaluation rank scores
checkpoints back to back for as long as training runs: pinned to core B (``eval.devices: [B]``,
disjoint) or to core A as well (``eval.share_devices: true``), alternating rounds. On GPUs the
same settings give each side GPUs of its own (``CUDA_VISIBLE_DEVICES``). Reports training
samples/s each way and the evaluations done; prints one JSON line. Needs 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
from pathlib import Path

from common import emit, median, prepared_run


def run_training(work: Path, steps: int, train_core: int, eval_core: int) -> dict:
    from areal_eval.checkpoints.manifest import Manifest
    from areal_eval.evaluation.jobs import run_evaluation_job
    from areal_eval.evaluation.worker_pool import WarmEvalWorkers
    from areal_eval.launchers.devices import plan_here
    from areal_eval.launchers.local import TorchrunJob

    cfg, run = prepared_run(
        f"separation-{eval_core}",
        work,
        train={"nproc": 1, "max_steps": steps, "devices": [train_core], "save": {"freq_steps": 50}},
        eval={"nproc": 1, "devices": [eval_core], "share_devices": train_core == eval_core},
    )
    plan = plan_here(cfg)
    for stale in (run.manifest, run.train_log):
        stale.unlink(missing_ok=True)
    job = TorchrunJob(
        "areal_eval.train", ["--config", str(run.train_config)], 1, run.logs / "train.log", placement=plan.train
    )
    evaluated, stop = [0], threading.Event()

    def evaluate_while_training():
        with WarmEvalWorkers(1, run.evals, placement=plan.eval_slots[0]) as workers:
            while not stop.is_set():
                events = Manifest(run.manifest).events() if run.manifest.exists() else []
                if not events:
                    stop.wait(0.2)
                    continue
                run_evaluation_job(events[-1], run.valid_data, cfg.eval, run.evals, workers=workers)
                evaluated[0] += 1

    evaluator = threading.Thread(target=evaluate_while_training)
    evaluator.start()
    try:
        job.wait(900)
        job.raise_for_status("training")
    finally:
        stop.set()
        evaluator.join()
    done = json.loads(run.train_log.read_text().splitlines()[-1])
    return {"samples_per_s": steps * cfg.train.batch_size / done["train_s"], "evaluated": evaluated[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs 2 CPU cores")
    a, b = cores[:2]
    disjoint, shared = [], []
    for i in range(args.rounds):  # alternate: this machine is noisy
        work = Path(tempfile.mkdtemp(prefix=f"bench-separation-{i}-"))
        disjoint.append(run_training(work / "disjoint", args.steps, a, b))
        shared.append(run_training(work / "shared", args.steps, a, a))
    emit(
        {
            "benchmark": "device_separation",
            "steps": args.steps,
            "rounds": args.rounds,
            "train_samples_per_s_disjoint": round(median(r["samples_per_s"] for r in disjoint), 1),
            "train_samples_per_s_shared": round(median(r["samples_per_s"] for r in shared), 1),
            "throughput_ratio_disjoint_shared": round(
                median(r["samples_per_s"] for r in disjoint) / median(r["samples_per_s"] for r in shared), 3
            ),
            "evaluations_disjoint": [r["evaluated"] for r in disjoint],
            "evaluations_shared": [r["evaluated"] for r in shared],
        }
    )


if __name__ == "__main__":
    main()
