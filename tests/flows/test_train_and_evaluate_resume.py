"""Never lose a run: ``kill -9`` the demo's command mid-run, then run the same command again.

Real processes and signals: the flow CLI with its temporary Prefect server, torchrun training
and warm evaluation workers, MLflow on SQLite.
"""

import contextlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil
import pytest

from areal_eval.checkpoints.manifest import Manifest
from areal_eval.runs.directory import RunDir
from areal_eval.runs.ledger import FINAL_STATES, Ledger
from areal_eval.tracking import Tracker, TrackingConfig
from tests import sink_points
from tests.conftest import TINY
from tests.helpers import alive, sqlite_mlflow_uri, tmpfs, wait_for
from tests.prefect_services import with_migrated_database

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


SINKS = ("mlflow", "tensorboard", "wandb")


def flow_command(config: Path) -> list[str]:
    return [sys.executable, "-m", "flows.train_and_evaluate", "--config", str(config)]


def clean_env(prefect_home: Path) -> dict:
    """Its own temporary Prefect server, on a database of the test's (not ``~/.prefect``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.pop("AREAL_EVAL_OWNER", None)
    env["PREFECT_HOME"] = str(with_migrated_database(prefect_home))
    env["WANDB_MODE"] = "offline"  # W&B's files only: nothing leaves the machine
    return env


def flow_run_states(prefect_home: Path, name: str) -> list[str]:
    """The states of the flow runs called ``name`` in that temporary server's database."""
    with contextlib.closing(sqlite3.connect(prefect_home / "prefect.db")) as db:
        return sorted(state for (state,) in db.execute("SELECT state_type FROM flow_run WHERE name = ?", (name,)))


def log_text(log) -> str:
    log.flush()
    return Path(log.name).read_text()


def start_flow(tmp_path: Path, run_name: str, max_steps: int, scheduler: dict, sinks: tuple = ("mlflow",)):
    """The demo's command on a tiny config, as its own process; returns it, its config, run and log."""
    params = {
        **TINY,
        "run_name": run_name,
        "work_dir": str(tmp_path),
        "tracking": {"tracking_uri": sqlite_mlflow_uri(tmp_path), "sinks": list(sinks)},
        "train": {**TINY["train"], "max_steps": max_steps, "epochs": 40, "save": {"freq_steps": 6}},
        "scheduler": scheduler,
    }
    config = tmp_path / "config.json"
    config.write_text(json.dumps(params))
    log = (tmp_path / f"{run_name}-flow.log").open("w")
    flow = subprocess.Popen(
        flow_command(config),
        cwd=ROOT,
        env=clean_env(tmp_path / "prefect"),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=as_in_a_terminal,
    )
    return flow, params, config, RunDir(tmp_path / run_name), log


def as_in_a_terminal() -> None:
    """SIGINT as a terminal's command has it: a shell starts a background job (the suite run as
    ``... &``) with SIGINT ignored, which every process below keeps."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_kill_9_leaves_nothing_running_and_the_same_command_resumes(tmp_path):
    flow, params, config, run, log = start_flow(
        tmp_path, "resume", 60, {"min_interval_steps": 0, "max_interval_steps": 12}, SINKS
    )
    try:

        def mid_run():
            steps = [e.global_step for e in Manifest(run.manifest).events()]
            return 12 <= max(steps, default=0) < 60

        wait_for(mid_run, 300, f"training past step 12 (flow log {log.name})")
        family = psutil.Process(flow.pid).children(recursive=True)
        assert any("areal_eval.train" in " ".join(p.cmdline()) for p in family)
        wandb_opened = (run.root / "sinks" / "wandb.json").exists()  # then the rerun resumes its W&B run
        os.kill(flow.pid, signal.SIGKILL)
        flow.wait(10)

        def all_gone():
            return not [p for p in family if alive(p)]

        wait_for(all_gone, 60, "training, workers and the temporary server to end")
        first_id = run.run_id
        published = [e.global_step for e in Manifest(run.manifest).events()]
    finally:
        if flow.poll() is None:
            os.killpg(flow.pid, signal.SIGKILL)

    tracker = Tracker(TrackingConfig(tracking_uri=params["tracking"]["tracking_uri"], experiment="areal-eval"))
    [killed] = tracker.client.search_runs([tracker.experiment_id])
    tracker.set_tags(killed.info.run_id, {"areal.failure": "interrupted (Ctrl-C)"})  # as a stopped run leaves it
    env = clean_env(tmp_path / "prefect")
    again = subprocess.run(flow_command(config), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert run.run_id == first_id  # resumed, not wiped
    # The killed flow run no longer shows as running: the one that took the run over ended it.
    assert flow_run_states(tmp_path / "prefect", "resume") == ["COMPLETED", "CRASHED"]
    events = Manifest(run.manifest).events()
    steps = [e.global_step for e in events]
    assert steps[: len(published)] == published and steps[-1] == 60 and events[-1].final
    assert steps == sorted(set(steps))  # every checkpoint published once
    ledger = Ledger(run.ledger)
    assert [e.step for e in ledger.entries()] == steps and all(e.status in FINAL_STATES for e in ledger.entries())
    evaluated = [e.step for e in ledger.entries() if e.status == "evaluated"]
    tracker = Tracker(TrackingConfig(tracking_uri=params["tracking"]["tracking_uri"], experiment="areal-eval"))
    [mlflow_run] = tracker.client.search_runs([tracker.experiment_id])  # the same MLflow run went on
    assert (
        mlflow_run.info.status == "FINISHED" and "areal.failure" not in mlflow_run.data.tags
    )  # history, not its failure
    assert mlflow_run.data.tags["areal.earlier_failures"] == "interrupted (Ctrl-C)"
    eval_steps = [m.step for m in tracker.client.get_metric_history(mlflow_run.info.run_id, "eval/accuracy")]
    assert sorted(eval_steps) == evaluated  # none evaluated twice, none lost
    train_steps = [m.step for m in tracker.client.get_metric_history(mlflow_run.info.run_id, "train/loss")]
    assert train_steps == sorted(set(train_steps)) and max(train_steps) == 60
    # The other sinks too: W&B resumed its run, TensorBoard wrote no step twice.
    sink_points.assert_sinks_hold(run.root, evaluated, train_steps)
    wandb_files = sink_points.run_files(run.root / "sinks", sink_points.wandb_run_id(run.root))
    assert len(wandb_files) == 1 + wandb_opened  # one W&B run, resumed under its id when the killed flow had it


def test_a_killed_training_rank_ends_the_run_failed_after_its_checkpoints_are_handled(tmp_path):
    flow, params, config, run, log = start_flow(
        tmp_path,
        "rank",
        400,
        {"policy": "fixed", "fixed_interval_steps": 1, "coalesce": False, "min_interval_steps": 0},
    )
    try:
        wait_for(
            lambda: max([e.global_step for e in Manifest(run.manifest).events()], default=0) >= 12,
            300,
            f"training past step 12 (flow log {log.name})",
        )
        # Training ranks are forked from their torchrun agent (areal_eval.launchers.forked_ranks), named by rank.
        ranks = [p for p in psutil.Process(flow.pid).children(recursive=True) if p.name() == "train-rank-1"]
        assert len(ranks) == 1
        ranks[0].kill()
        assert flow.wait(300) == 1
    finally:
        if flow.poll() is None:
            os.killpg(flow.pid, signal.SIGKILL)
    published = [e.global_step for e in Manifest(run.manifest).events()]
    ledger = Ledger(run.ledger)
    assert [e.step for e in ledger.entries()] == published  # every published checkpoint handled
    assert all(e.status == "evaluated" for e in ledger.entries())
    assert (run.root / "evaluation_curve.png").exists()
    tracker = Tracker(TrackingConfig(tracking_uri=params["tracking"]["tracking_uri"], experiment="areal-eval"))
    [mlflow_run] = tracker.client.search_runs([tracker.experiment_id])
    assert mlflow_run.info.status == "FAILED" and "training failed" in mlflow_run.data.tags["areal.failure"]
    output = (tmp_path / "rank-flow.log").read_text()  # one line first; the tracebacks are in a file
    assert "Traceback" not in output
    assert re.fullmatch(
        r"stopped: WorkerError: training failed.*; the same command resumes the run: .* \(traceback in .*\)",
        output.rstrip().splitlines()[-1],
    )
    assert "WorkerError" in (run.logs / "tracebacks.log").read_text()
    assert (
        sorted(m.step for m in tracker.client.get_metric_history(mlflow_run.info.run_id, "eval/accuracy")) == published
    )


@pytest.mark.parametrize(
    "sig, cause", [(signal.SIGINT, "interrupted (Ctrl-C)"), (signal.SIGTERM, "terminated by SIGTERM")]
)
def test_ctrl_c_or_sigterm_stops_everything_in_one_line_and_ends_mlflow_killed(tmp_path, sig, cause):
    """The terminal's Ctrl-C is a SIGINT to the command's whole process group: the command stops
    training, evaluation and its Prefect server, ends MLflow KILLED and says so in one line,
    naming the command that resumes the run."""
    # Training long enough to be under way when the signal comes (36 steps could all be done,
    # and the run finished, before the test sent it).
    flow, params, config, run, log = start_flow(
        tmp_path, "ctrlc", 600, {"min_interval_steps": 0, "max_interval_steps": 12}
    )
    try:
        wait_for(lambda: len(Manifest(run.manifest).events()) >= 3, 300, f"three checkpoints (flow log {log.name})")
        family = psutil.Process(flow.pid).children(recursive=True)
        assert not any(e.final for e in Manifest(run.manifest).events())
        assert any("prefect" in " ".join(p.cmdline()) and "server" in p.cmdline() for p in family)
        # The UI it prints calls that server's API (not the default port 4200's).
        ui = re.search(r"Prefect UI for this run \(up while it lasts\): (http://\S+)/runs", log_text(log)).group(1)
        settings = json.loads(urllib.request.urlopen(f"{ui}/ui-settings", timeout=10).read())
        assert settings["api_url"] == f"{ui}/api"
        os.killpg(flow.pid, sig)
        assert flow.wait(120) == 128 + sig
        wait_for(lambda: not [p for p in family if alive(p)], 30, "all gone")
    finally:
        if flow.poll() is None:
            os.killpg(flow.pid, signal.SIGKILL)
    output = (tmp_path / "ctrlc-flow.log").read_text()
    assert "Traceback" not in output
    resume = f"python -m flows.train_and_evaluate --config {config}"
    last = output.rstrip().splitlines()[-1]
    assert last == f"stopped: {cause}; the same command resumes the run: {resume}"
    tracker = Tracker(TrackingConfig(tracking_uri=params["tracking"]["tracking_uri"], experiment="areal-eval"))
    [mlflow_run] = tracker.client.search_runs([tracker.experiment_id])
    assert mlflow_run.info.status == "KILLED" and mlflow_run.data.tags["areal.failure"] == cause


@pytest.fixture
def small_disk(tmp_path):
    """A real 8 MB tmpfs: checkpoints fill it within the run."""
    with tmpfs(tmp_path / "small-disk", "8m") as mount:
        yield mount


def test_a_full_disk_ends_the_mlflow_run_failed_naming_the_path_and_what_was_being_written(tmp_path, small_disk):
    """The run directory on a disk that fills up, MLflow's store elsewhere: the run ends FAILED
    with the cause, and the stop line names the path and what was being written."""
    params = {
        **TINY,
        "run_name": "full",
        "work_dir": str(small_disk),
        "tracking": {"tracking_uri": sqlite_mlflow_uri(tmp_path)},
        "train": {**TINY["train"], "max_steps": 2000, "epochs": 400, "save": {"freq_steps": 2}},
    }
    config = tmp_path / "config.json"
    config.write_text(json.dumps(params))
    done = subprocess.run(
        flow_command(config), cwd=ROOT, env=clean_env(tmp_path / "prefect"), capture_output=True, text=True, timeout=600
    )
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    last = output.rstrip().splitlines()[-1]
    written = rf"stopped: out of disk space: .*no space left on the disk of {small_disk}/full/\S+ while writing "
    assert re.match(written, last), last
    assert "free space there, then the same command resumes the run" in last
    assert "Traceback" not in output
    # An evaluation on the full disk stops the run at once, unretried, its checkpoint still scheduled.
    assert "retrying in" not in output and "queued again" not in output
    ledger = Ledger(small_disk / "full" / "ledger.jsonl")
    statuses = {ledger.status(e.step) for e in ledger.entries()}
    # Training may fill the disk before the loop schedules anything (a loaded machine starts the
    # flow's loop late): then no evaluation ran, and the line above names what training wrote.
    assert "scheduled" in statuses or not statuses, statuses
    tracker = Tracker(TrackingConfig(tracking_uri=params["tracking"]["tracking_uri"], experiment="areal-eval"))
    [mlflow_run] = tracker.client.search_runs([tracker.experiment_id])
    assert mlflow_run.info.status == "FAILED"
    assert mlflow_run.data.tags["areal.failure"].startswith("out of disk space: ")
