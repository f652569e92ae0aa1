"""Services and wiring for ``bench/scale.py``: an ``mlflow server`` on loopback, and the follow
loop inside a Prefect flow behind the flow's own task wiring (``--prefect``)."""

from __future__ import annotations

import time
from pathlib import Path


def run_in_flow(planner, training, job, rules, loop_cfg, tracker, mlflow_run_id, evaluator, timings, observe, counters):
    """The loop inside a Prefect flow behind the flow's own wiring (``tasks.loop_io``), with the
    minimal evaluator as its evaluation task; returns the ledger and the IO, and puts a task-run
    counter in ``counters``."""
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.context import get_run_context

    from areal_eval.alerts import AlertEngine
    from areal_eval.checkpoints.manifest import Manifest
    from areal_eval.lifecycle.follow_loop import FollowLoop
    from areal_eval.pipeline.config import load_pipeline_config
    from areal_eval.runs.directory import RunDir
    from tasks.loop_io import PrefectLoopIO, TaskHandle

    evaluate_step = task(evaluator.__call__, name="evaluate-step", cache_policy=NO_CACHE)
    cfg = load_pipeline_config(params={"tracking": {"tracking_uri": tracker.tracking_uri, "experiment": "scale"}})

    class BenchIO(PrefectLoopIO):
        alerts = 0

        def submit(self, event, reason):
            return TaskHandle(evaluate_step.submit(event))

        def log_result(self, result, reason):
            timings.timed("evaluation_log", super().log_result, result, reason)

        def log_training(self, rows):
            timings.timed("train_flush", super().log_training, rows)

        def send_alert(self, alert):
            self.alerts += 1
            super().send_alert(alert)

    state = {}

    def count_task_runs() -> int:
        flow_filter = FlowRunFilter(id=FlowRunFilterId(any_=[state["flow_run_id"]]))
        total, page = 0, 200
        with get_client(sync_client=True) as client:
            while True:
                got = len(client.read_task_runs(flow_run_filter=flow_filter, limit=page, offset=total))
                total += got
                if got < page:
                    return total

    @flow(name="scale-benchmark")
    def follow_in_flow():
        state["flow_run_id"] = get_run_context().flow_run.id
        counters["task_runs"] = count_task_runs
        io = BenchIO(
            cfg,
            RunDir(training.root),
            mlflow_run_id,
            planner.ledger,
            training.checkpoints * training.rows_per_checkpoint,
        )
        loop = FollowLoop(
            planner,
            Manifest(training.manifest),
            training.train_log,
            AlertEngine(rules),
            io,
            loop_cfg,
            job,
            on_iteration=observe,
        )
        return loop.run(), io

    ledger, io = follow_in_flow()
    time.sleep(2)  # task runs are recorded through events
    return ledger, io


def mlflow_server(db: Path, artifacts: Path):
    from tests.helpers import start_mlflow_server

    proc = start_mlflow_server(db, artifacts)
    return proc, proc.url
