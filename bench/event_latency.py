"""Event -> MLflow on a real Prefect server: how long a trainer outside the flow waits for feedback.

    .venv/bin/python bench/event_latency.py [--events 6] [--every-s 25]
        [--path trigger:10 --path trigger:1 --path service]

Trains the demo's reward model once (tiny size), then for each path starts the README's server
set-up (``tests/prefect_services.py``: server on loopback, pools, ``gpu:0``,
``infra/prefect.yaml``'s deployments, a worker per pool). ``trigger:Q``: the deployment trigger,
its worker polling every Q seconds (``PREFECT_WORKER_QUERY_SECONDS``; Prefect's default is 10);
``service``: ``flows/serve_evaluations.py`` with the trigger paused. A trainer publishes ``--events`` checkpoints with
``publish_checkpoint`` (which posts ``areal.checkpoint.saved``), far enough apart that no two
evaluations wait on each other. For each evaluated checkpoint it reads, from the Prefect API and
MLflow: event posted -> flow run created (the automation) -> flow run started (worker poll,
subprocess) -> evaluation task started (flow import, decision, MLflow run) -> metric in MLflow.
Prints p50/p99 of each and one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
import time
import urllib.request
from pathlib import Path

from common import emit, percentile, trained_tiny_run

STAGES = ("created", "started", "evaluating", "in_mlflow")


def api(env: dict, path: str, body: dict) -> list | dict:
    request = urllib.request.Request(
        env["PREFECT_API_URL"] + path,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def seconds(iso: str | None) -> float | None:
    return datetime.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp() if iso else None


def start_service(env: dict, home: Path):
    """``serve-evaluations`` in place of the automation; returns it once it listens."""
    import subprocess
    import sys

    from tests.prefect_services import REPO, cli

    cli(env, "automation", "pause", "evaluate-published-checkpoint")
    log = home / "service.log"
    service = subprocess.Popen(
        [sys.executable, "-m", "flows.serve_evaluations", "--set", f"work_dir={home / 'work'}"],
        cwd=REPO,
        env=env,
        start_new_session=True,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    while "listening" not in log.read_text():
        if service.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"serve-evaluations did not start: {log.read_text()[-2000:]}")
        time.sleep(0.5)
    return service


def measure(work: Path, trained, events: int, every_s: float, path: str) -> dict:
    from areal_eval.checkpoints.manifest import Manifest
    from areal_eval.checkpoints.publisher import publish_checkpoint
    from areal_eval.tracking import Tracker, TrackingConfig
    from tests.prefect_services import prefect_server

    _, run = trained
    checkpoints = [e.uri for e in Manifest(run.manifest).events()]
    query_s = float(path.split(":")[1]) if path.startswith("trigger:") else 10.0
    name = path.replace(":", "-")
    home = work / name
    home.mkdir(parents=True)
    run_id = f"latency-{name}"
    manifest = home / run_id / "manifest.jsonl"
    with prefect_server(home, worker_query_s=query_s) as env:
        service = start_service(env, home) if path == "service" else None
        posted = {}
        for i in range(events):  # step gaps of 100: the default scheduler evaluates each one
            started = time.monotonic()
            publish_checkpoint(
                checkpoints[i % len(checkpoints)],
                manifest,
                run_id,
                global_step=100 * i,
                final=i == events - 1,
                valid_data=run.valid_data,
                api_url=env["PREFECT_API_URL"],
                train_metrics={"loss": 1.0 / (i + 1)},
            )
            posted[100 * i] = time.time()
            time.sleep(max(0.0, every_s - (time.monotonic() - started)))
        deadline = time.monotonic() + 600
        while True:
            flow_runs = [
                r for r in api(env, "/flow_runs/filter", {"limit": 200}) if r["parameters"].get("run_id") == run_id
            ]
            if len(flow_runs) >= events and all(
                r["state_type"] in ("COMPLETED", "FAILED", "CRASHED") for r in flow_runs
            ):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"flow runs not finished: {[r['state_type'] for r in flow_runs]}")
            time.sleep(2)
        task_runs = api(env, "/task_runs/filter", {"limit": 200})
        tracker = Tracker(TrackingConfig(tracking_uri=env["MLFLOW_TRACKING_URI"], experiment="areal-eval"))
        history = tracker.client.get_metric_history(tracker.find_run(run_id), "eval/accuracy")
        if service is not None:
            from tests.prefect_services import stop

            stop(service)
    landed = {m.step: m.timestamp / 1000 for m in history}
    rows = []
    for step, sent in sorted(posted.items()):
        flow_run = next((r for r in flow_runs if r["parameters"].get("global_step") == step), None)
        if flow_run is None or step not in landed:
            continue
        task = min(
            (t for t in task_runs if t["flow_run_id"] == flow_run["id"] and t["name"] == f"evaluate-step-{step}"),
            key=lambda t: t["start_time"] or "",
            default=None,
        )
        rows.append(
            {
                "step": step,
                "created": seconds(flow_run["created"]) - sent,
                "started": seconds(flow_run["start_time"]) - sent,
                "evaluating": seconds(task["start_time"]) - sent if task and task["start_time"] else None,
                "in_mlflow": landed[step] - sent,
            }
        )
    summary = {
        stage: {
            "p50_s": round(percentile([r[stage] for r in rows if r[stage] is not None], 0.5), 1),
            "p99_s": round(percentile([r[stage] for r in rows if r[stage] is not None], 0.99), 1),
        }
        for stage in STAGES
    }
    return {
        "path": path,
        "events": events,
        "evaluated": len(rows),
        "failed_flow_runs": sum(r["state_type"] != "COMPLETED" for r in flow_runs),
        "from_event": summary,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=6)
    parser.add_argument("--every-s", type=float, default=25.0, help="seconds between published checkpoints")
    parser.add_argument("--path", action="append", help="trigger:QUERY_SECONDS or service (repeatable)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-event-latency-"))
    trained = trained_tiny_run(work)
    results = [
        measure(work, trained, args.events, args.every_s, p)
        for p in (args.path or ["trigger:10", "trigger:1", "service"])
    ]
    for r in results:
        print(
            f"{r['path']}: "
            + ", ".join(f"{stage} p50 {v['p50_s']}s p99 {v['p99_s']}s" for stage, v in r["from_event"].items())
        )
    emit({"benchmark": "event_latency", "results": results})


if __name__ == "__main__":
    main()
