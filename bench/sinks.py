"""What each sink adds to the recording of an evaluation, side by side in one run.

    .venv/bin/python bench/sinks.py [--results 20] [--items 200] [--rounds 2]

For each combination of ``tracking.sinks`` (MLflow alone, MLflow with TensorBoard, with W&B,
with both, and TensorBoard without MLflow), a fresh MLflow store (SQLite) and run directory
take ``--results`` results, one per training step, each with a per-item file of ``--items``
answers, through the one recording step (``Recorder.result``, as every path records), then the
run's end. W&B runs offline (``WANDB_MODE=offline``): nothing leaves the machine. Rounds repeat
the combinations in turn, so each sees the same machine. Reports, per combination, the median
and p90 seconds of a result's recording after the first, its ratio to MLflow alone, the first
result's seconds (it opens the sinks: W&B's service and run, an event file) and the run's end;
prints one JSON line.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from common import emit, median, percentile

COMBINATIONS = (
    ("mlflow",),
    ("mlflow", "tensorboard"),
    ("mlflow", "wandb"),
    ("mlflow", "wandb", "tensorboard"),
    ("tensorboard",),
)


def items_file(path: Path, step: int, n: int) -> dict[str, str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = {
        "item": list(range(n)),
        "prompt": [f"What is {i} + {step}?" for i in range(n)],
        "answer": [f"The answer is {i + step}." for i in range(n)],
        "reward": [float((i * 7 + step) % 3 != 0) for i in range(n)],
    }
    pq.write_table(pa.table(rows), path)
    return {"generation": str(path)}


def record_run(sinks: tuple[str, ...], work: Path, results: int, items: int) -> dict:
    from areal_eval.evaluation.jobs import EvalResult
    from areal_eval.recording import Recorder
    from areal_eval.runs.directory import RunDir
    from areal_eval.runs.ledger import Ledger, LedgerEntry
    from areal_eval.sinks import TensorBoardConfig, WandbConfig, open_sinks
    from areal_eval.tracking import Tracker, TrackingConfig

    run = RunDir(work / "run")
    run.root.mkdir(parents=True)
    failures: list[str] = []
    cfg = TrackingConfig(experiment="bench", sinks=list(sinks))
    tracker = Tracker(cfg, work_dir=work)
    mlflow_run_id = tracker.start_run("bench", {})
    others = [name for name in sinks if name != "mlflow"]
    made = None
    if others:
        made = open_sinks(
            others,
            wandb=WandbConfig(mode="offline", project="bench"),
            tensorboard=TensorBoardConfig(),
            run_dir=run.root,
            run_name="bench",
            on_failure=lambda sink, message: failures.append(message),
            single_writer=True,
        )
    recorder = Recorder(
        tracker,
        mlflow_run_id,
        run=run,
        training_run_id="bench",
        ledger=Ledger(run.ledger),
        sinks=made,
        to_mlflow=cfg.to_mlflow,
        registered_model="bench-{run_id}",
        warn=failures.append,
    )
    seconds = []
    for i in range(results):
        step = 10 * i
        accuracy = 0.5 + 0.4 * i / results
        recorder.ledger.append(LedgerEntry(step, f"/ckpt/{step}", "evaluated", "due", metrics={"accuracy": accuracy}))
        result = EvalResult(
            step,
            f"/ckpt/{step}",
            {"accuracy": accuracy, "accuracy_stderr": 0.02, "n_answers": items},
            1.0,
            items=items_file(work / f"items-{step}.parquet", step, items),
        )
        start = time.perf_counter()
        recorder.result(result)
        seconds.append(time.perf_counter() - start)
    start = time.perf_counter()
    recorder.end(recorder.ledger, None, status="FINISHED")
    ended = time.perf_counter() - start
    if failures:
        raise SystemExit(f"{'+'.join(sinks)}: {failures[0]}")
    return {"seconds": seconds, "end_s": ended}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=int, default=20, help="results recorded per combination and round")
    parser.add_argument("--items", type=int, default=200, help="answers in each result's per-item file")
    parser.add_argument("--rounds", type=int, default=2, help="times each combination is measured, in turn")
    args = parser.parse_args()
    os.environ["WANDB_MODE"] = "offline"  # nothing leaves the machine
    # Imported before any measurement: each combination's first result then opens its sinks
    # (W&B's service and run, an event file), not the packages.
    import wandb  # noqa: F401
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: F401
    from torch.utils.tensorboard import SummaryWriter  # noqa: F401

    os.environ.pop("MLFLOW_TRACKING_URI", None)  # each combination its own SQLite store
    per: dict[str, list[float]] = {}
    ends: dict[str, list[float]] = {}
    firsts: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-sinks-") as tmp:
        os.environ["WANDB_DIR"] = tmp
        for round_ in range(args.rounds):
            for sinks in COMBINATIONS:
                name = "+".join(sinks)
                out = record_run(sinks, Path(tmp) / f"{round_}-{name}", args.results, args.items)
                per.setdefault(name, []).extend(out["seconds"][1:])  # the first opens the sinks
                firsts.setdefault(name, []).append(out["seconds"][0])
                ends.setdefault(name, []).append(out["end_s"])
    base = median(per["mlflow"])
    emit(
        {
            "results": args.results,
            "items": args.items,
            "rounds": args.rounds,
            "per_result": {
                name: {
                    "median_s": round(median(s), 4),
                    "p90_s": round(percentile(s, 0.9), 4),
                    "vs_mlflow_alone": round(median(s) / base, 2),
                }
                for name, s in per.items()
            },
            "first_result_s": {name: round(median(s), 3) for name, s in firsts.items()},
            "run_end_s": {name: round(median(s), 3) for name, s in ends.items()},
        }
    )


if __name__ == "__main__":
    main()
