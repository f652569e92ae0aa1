"""Long runs: does the pipeline's per-checkpoint and per-flush cost stay flat?

    .venv/bin/python bench/scale.py [--checkpoints 5000] [--rows 200000] [--tracking sqlite|server|both] [--prefect]

A synthetic training run (a process of its own, as training is) publishes ``--checkpoints`` real
checkpoints (a safetensors file each, published with ``publish_checkpoint``: sizes, sha256,
manifest) and writes ``--rows`` training-log rows, at an even pace. The library's follow loop
(``FollowLoop``: manifest follower, decision thread, planner, ledger, alert rules, the tracker on
MLflow) follows it exactly as the ``train-and-evaluate`` flow does; evaluations are answered by a
minimal real evaluator (verify the files, load the weights, score 400 labelled points, with a
standard error) in one slot.

At 10%, 50% and 100% of the run it reports, each over the last 5% of the checkpoints before that
mark: durable->decision p50/p99 (from the moment the manifest line is fsynced, so a decision made
while the writer is still in fsync counts as negative), the decision itself (``planner.offer``),
time per train-metric flush and per evaluation log, flow-loop iteration time, and the process's
resident memory; the ratios of 100% to 10% (p50s, and the p99 of durable->decision); with
``--prefect`` the loop runs inside a Prefect flow behind the flow's own task wiring, and the task
runs created so far are counted on the Prefect API. Then it checks MLflow for duplicate or missing
points and relogs the whole training log as a resumed flow would (nothing may be logged twice).

Prints one JSON line per tracking store.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import ROOT, ProcessJob, emit, percentile  # noqa: F401 (sets up sys.path and env)
from scale_services import mlflow_server, run_in_flow

MARKS = (0.1, 0.5, 1.0)
WINDOW = 0.05
POINTS = 400
DIM = 16


class SyntheticTraining:
    """Publishes checkpoints whose weights approach a target (a learning curve that rises, then
    plateaus, with a regression at 70%), and the training log between them."""

    def __init__(self, root: Path, checkpoints: int, rows: int, every_s: float):
        import multiprocessing

        self.root, self.checkpoints, self.every_s = root, checkpoints, every_s
        self.rows_per_checkpoint = max(1, rows // checkpoints)
        self.manifest = root / "manifest.jsonl"
        self.train_log = root / "train_log.jsonl"
        self.context = multiprocessing.get_context("spawn")
        self._published = self.context.Value("i", 0)
        self.durable_at = self.context.Array("d", checkpoints, lock=False)
        """Wall time each checkpoint's manifest line was fsynced (the event's own ``wall_time`` is
        stamped before, while the line is being written)."""

    @property
    def target(self):
        import torch

        return torch.randn(DIM, generator=torch.Generator().manual_seed(0))

    @property
    def published(self) -> int:
        """Checkpoints published so far."""
        return self._published.value

    def start(self):
        process = self.context.Process(target=self.run, name="synthetic-training")
        process.start()
        return process

    def weights(self, i: int):
        import torch

        initial, noise = torch.randn(2, DIM, generator=torch.Generator().manual_seed(i + 1))
        progress = 1 - math.exp(-6 * i / self.checkpoints)
        w = initial * (1 - progress) + self.target * progress
        if i >= 0.7 * self.checkpoints:  # a regression late in the run
            w = w - 0.6 * self.target
        return w + 0.05 * noise

    def run(self) -> None:
        from safetensors.torch import save_file

        from areal_eval.checkpoints.publisher import publish_checkpoint

        next_at = time.monotonic()
        with self.train_log.open("a") as log:
            for i in range(self.checkpoints):
                step = (i + 1) * self.rows_per_checkpoint
                for s in range(step - self.rows_per_checkpoint + 1, step + 1):
                    log.write(json.dumps({"step": s, "loss": 1.0 / math.sqrt(s)}) + "\n")
                log.flush()
                directory = self.root / "checkpoints" / f"global_step_{step:08d}"
                directory.mkdir(parents=True)
                save_file({"w": self.weights(i)}, str(directory / "model.safetensors"))
                publish_checkpoint(directory, self.manifest, "scale", step, final=i == self.checkpoints - 1)
                self.durable_at[i] = time.time()
                self._published.value = i + 1
                next_at += self.every_s
                time.sleep(max(0.0, next_at - time.monotonic()))


class TinyEvaluator:
    """A real evaluation, minimal: verify the files, load the weights, score labelled points."""

    def __init__(self, target):
        import torch

        gen = torch.Generator().manual_seed(2)
        self.x = torch.randn(POINTS, DIM, generator=gen)
        self.y = (self.x @ target) > 0

    def __call__(self, event):
        from safetensors.torch import load_file

        from areal_eval.checkpoints.manifest import verify_checkpoint
        from areal_eval.evaluation.jobs import EvalResult

        start = time.monotonic()
        verify_checkpoint(event.uri, event.files)
        w = load_file(str(Path(event.uri) / "model.safetensors"))["w"]
        correct = ((self.x @ w > 0) == self.y).double()
        p = correct.mean().item()
        metrics = {
            "accuracy": p,
            "accuracy_stderr": math.sqrt(max(p * (1 - p), 1e-4) / POINTS),
            "n_pairs": float(POINTS),
        }
        return EvalResult(event.global_step, event.uri, metrics, time.monotonic() - start)


class Timings:
    """(checkpoints published when it happened, seconds) per operation, and RSS at the marks."""

    def __init__(self, training: SyntheticTraining):
        self.training = training
        self.ops: dict[str, list[tuple[int, float]]] = {}
        self.lock = threading.Lock()

    def add(self, op: str, seconds: float) -> None:
        with self.lock:
            self.ops.setdefault(op, []).append((self.training.published, seconds))

    def timed(self, op: str, fn, *args):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.add(op, time.perf_counter() - start)

    def window(self, op: str, mark: float) -> list[float]:
        n = self.training.checkpoints
        lo, hi = n * (mark - WINDOW), n * mark
        return [s for at, s in self.ops.get(op, []) if lo < at <= hi]


class PlainIO:
    """The loop's effects as the flow has them, without Prefect: MLflow calls and a thread."""

    def __init__(self, tracker, mlflow_run_id: str, evaluate, timings: Timings, run_dir: Path, ledger):
        from areal_eval.recording import Recorder
        from areal_eval.runs.directory import RunDir

        self.tracker, self.mlflow_run_id, self.evaluate, self.timings = tracker, mlflow_run_id, evaluate, timings
        # The flows' recording step, as the in-flow loop has it (its ledger in memory).
        self.recorder = Recorder(tracker, mlflow_run_id, run=RunDir(run_dir), training_run_id="scale", ledger=ledger)
        self.pool = concurrent.futures.ThreadPoolExecutor(1)
        self.alerts = 0

    def announce(self, event):
        pass

    def submit(self, event, reason):
        return self.pool.submit(self.evaluate, event)

    def log_result(self, result, reason):
        self.timings.timed("evaluation_log", self.recorder.result, result)

    def send_alert(self, alert):
        self.alerts += 1
        self.tracker.set_tags(self.mlflow_run_id, {f"alert.{alert.rule}": f"step {alert.step}: {alert.message}"})

    def log_training(self, rows):
        self.timings.timed("train_flush", self.recorder.training, rows)

    def delete_checkpoints(self, events):
        raise AssertionError("retention is off in this benchmark")

    def info(self, message):
        pass

    def warn(self, message):
        print("warning:", message, file=sys.stderr)


def stats_ms(values: list[float]) -> dict:
    return {
        "p50_ms": round(percentile(values, 0.5) * 1000, 2),
        "p99_ms": round(percentile(values, 0.99) * 1000, 2),
        "n": len(values),
    }


def run_once(args, tracking: str, work: Path) -> dict:
    import psutil

    from areal_eval.alerts import AlertEngine, AlertRule, AlertsConfig
    from areal_eval.checkpoints.manifest import Manifest
    from areal_eval.lifecycle.follow_loop import FollowLoop, LoopConfig
    from areal_eval.lifecycle.planner import EvaluationPlanner
    from areal_eval.runs.ledger import Ledger
    from areal_eval.scheduling.policy import SchedulerConfig
    from areal_eval.tracking import Tracker, TrackingConfig

    work.mkdir(parents=True)
    server = None
    if tracking == "server":
        server, uri = mlflow_server(work / "mlflow-server.db", work / "mlflow-artifacts")
    else:
        uri = f"sqlite:///{work / 'mlflow.db'}"
    try:
        tracker = Tracker(TrackingConfig(tracking_uri=uri, experiment="scale"))
        mlflow_run_id = tracker.start_run("scale", {"bench": "scale"})
        every_ms = args.every_ms or {"sqlite": 40.0, "server": 100.0}[tracking]
        training = SyntheticTraining(work / "run", args.checkpoints, args.rows, every_ms / 1000)
        timings = Timings(training)
        evaluator = TinyEvaluator(training.target)

        class TimedPlanner(EvaluationPlanner):
            def offer(self, event):  # the decision itself: the per-checkpoint cost of the scheduler
                return timings.timed("decision", super().offer, event)

        planner = TimedPlanner(SchedulerConfig(), Ledger(work / "run" / "ledger.jsonl"))
        rules = AlertsConfig(
            rules=[
                AlertRule(name="eval-failed", kind="eval_failed", throttle_secs=0),
                AlertRule(name="accuracy-regression", kind="regression", metric="accuracy", tolerance=0.1),
            ]
        )
        process = psutil.Process()
        memory: dict[float, int] = {}
        task_runs: dict[float, int] = {}
        counters: dict = {}
        """``task_runs``: a function counting the flow run's task runs (with --prefect)."""

        def observe(seconds: float) -> None:
            timings.add("loop_iteration", seconds)
            for mark in MARKS:
                if mark not in memory and training.published >= mark * args.checkpoints:
                    memory[mark] = process.memory_info().rss
                    if "task_runs" in counters:
                        task_runs[mark] = counters["task_runs"]()

        loop_cfg = LoopConfig(poll_interval_s=0.5, train_log_every_s=args.flush_every_s)
        (work / "run").mkdir()
        (work / "run" / "run_id").write_text("scale")  # a run directory as prepare_run leaves it
        writer = training.start()
        start = time.monotonic()
        if args.prefect:
            ledger, io = run_in_flow(
                planner,
                training,
                ProcessJob(writer),
                rules,
                loop_cfg,
                tracker,
                mlflow_run_id,
                evaluator,
                timings,
                observe,
                counters,
            )
            alerts = io.alerts
            task_runs[1.0] = counters["task_runs"]()
        else:
            io = PlainIO(tracker, mlflow_run_id, evaluator, timings, work / "run", planner.ledger)
            loop = FollowLoop(
                planner,
                Manifest(training.manifest),
                training.train_log,
                AlertEngine(rules),
                io,
                loop_cfg,
                ProcessJob(writer),
                on_iteration=observe,
            )
            ledger = loop.run()
            io.pool.shutdown()
            alerts = io.alerts
        elapsed = time.monotonic() - start
        writer.join()
        if writer.exitcode:
            raise RuntimeError(f"synthetic training failed: exit {writer.exitcode}")
        memory.setdefault(1.0, process.memory_info().rss)

        steps = [e.global_step for e in Manifest(training.manifest).events()]
        durable = dict(zip(steps, training.durable_at, strict=False))
        decided, published_at = {}, {}
        for line in (work / "run" / "ledger.jsonl").read_text().splitlines():
            row = json.loads(line)
            decided.setdefault(row["step"], row["time"])
        for index, step in enumerate(sorted(durable), start=1):
            published_at[step] = index
        latency = [(published_at[s], decided[s] - t) for s, t in durable.items() if s in decided]

        # Idempotence: exactly one point per step in MLflow, and a resumed flow relogs nothing.
        train_steps = [m.step for m in tracker.client.get_metric_history(mlflow_run_id, "train/loss")]
        eval_steps = [m.step for m in tracker.client.get_metric_history(mlflow_run_id, "eval/accuracy")]
        evaluated = sorted(e.step for e in ledger.entries() if e.status == "evaluated")
        all_rows = [json.loads(line) for line in training.train_log.read_text().splitlines()]
        relogged = Tracker(TrackingConfig(tracking_uri=uri, experiment="scale")).log_train_metrics(
            mlflow_run_id, all_rows
        )
        counts = ledger.counts()

        marks = {}
        n = args.checkpoints
        for mark in MARKS:
            lo, hi = n * (mark - WINDOW), n * mark
            marks[f"{int(mark * 100)}%"] = {
                "durable_to_decision": stats_ms([s for at, s in latency if lo < at <= hi]),
                "decision": stats_ms(timings.window("decision", mark)),
                "slowest_decisions": sorted(
                    ((round(s * 1000, 1), at) for at, s in latency if lo < at <= hi), reverse=True
                )[:3],
                "train_flush": stats_ms(timings.window("train_flush", mark)),
                "evaluation_log": stats_ms(timings.window("evaluation_log", mark)),
                "loop_iteration": stats_ms(timings.window("loop_iteration", mark)),
                "rss_mb": round(memory.get(mark, 0) / 2**20, 1),
                **({"task_runs": task_runs.get(mark)} if args.prefect else {}),
            }
        first, last = marks["10%"], marks["100%"]
        ratio = {
            op: round(last[op]["p50_ms"] / first[op]["p50_ms"], 2) if first[op]["p50_ms"] else None
            for op in ("decision", "train_flush", "evaluation_log", "loop_iteration")
        }
        ratio["durable_to_decision_p99"] = round(
            last["durable_to_decision"]["p99_ms"] / first["durable_to_decision"]["p99_ms"], 2
        )
        return {
            "benchmark": "scale",
            "tracking": tracking,
            "prefect": args.prefect,
            "checkpoints": n,
            "rows": len(all_rows),
            "every_ms": every_ms,
            "seconds": round(elapsed, 1),
            "ledger": counts,
            "alerts": alerts,
            "marks": marks,
            "p50_ratio_100_vs_10": ratio,
            "durable_to_decision_p99_ms_at_100": last["durable_to_decision"]["p99_ms"],
            "bytes_per_checkpoint": round((memory[1.0] - memory[0.1]) / (0.9 * n)),
            "train_points_duplicated": len(train_steps) - len(set(train_steps)),
            "train_steps_missing": len(all_rows) - len(set(train_steps)),
            "eval_points_duplicated": len(eval_steps) - len(set(eval_steps)),
            "eval_steps_match_ledger": sorted(set(eval_steps)) == evaluated,
            "relogged_after_resume": relogged,
        }
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=int, default=5000)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument(
        "--every-ms",
        type=float,
        default=None,
        help="time between checkpoints (default: 40 on SQLite, 100 on a server, which takes a training "
        "row in about 1 ms against 0.2 ms: the run is paced so that MLflow keeps up)",
    )
    parser.add_argument("--flush-every-s", type=float, default=2.0, help="training-metric flush interval")
    parser.add_argument("--tracking", choices=("sqlite", "server", "both"), default="both")
    parser.add_argument("--prefect", action="store_true", help="run the loop inside a Prefect flow (task runs counted)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    for tracking in ("sqlite", "server") if args.tracking == "both" else (args.tracking,):
        emit(run_once(args, tracking, work / tracking))


if __name__ == "__main__":
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    main()
