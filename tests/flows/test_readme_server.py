"""The README's *Run on a Prefect server*, command by command as a user pastes them, against a
real ``prefect server``, with a trainer publishing: a README that drifts fails here.

The commands are read from the README's section (its indented code blocks, in order, and the
command that pauses the sweep) and run in one shell, in a checkout of their own (the repository's
files linked, ``runs/`` empty), with two changes a user on this machine would make too: free
ports for 4200 and 5000, and ``configs/server.yaml`` edited as docs/server.md shows (TensorBoard
beside MLflow, one evaluation rank)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests import sink_points
from tests.helpers import free_port
from tests.prefect_services import REPO, with_migrated_database

pytestmark = pytest.mark.integration

SECTION = "## Run on a Prefect server"
PAUSE_SWEEP = re.compile(r"`(\.venv/bin/prefect deployment schedule pause --all)`")
SERVER_YAML = "eval:\n  nproc: 1\ntracking:\n  sinks: [mlflow, tensorboard]\n"


def readme_section() -> str:
    text = (REPO / "README.md").read_text()
    start = text.index(SECTION)
    return text[start : text.index("\n## ", start + len(SECTION))]


def commands(section: str) -> list[str]:
    """The section's commands: each indented code block's lines, in order, a line ending in a
    backslash joined to the next, as a shell reads them."""
    found = []
    for block in re.findall(r"(?:^ {4,}\S.*\n)+", section, flags=re.MULTILINE):
        found += [line.strip() for line in block.replace("\\\n", " ").splitlines()]
    return found


def test_the_readme_section_has_the_commands_this_test_walks():
    said = [" ".join(c.split()) for c in commands(readme_section())]
    assert any(c.startswith("PREFECT_API_URL=") and ".venv/bin/torchrun" in c for c in said), said
    assert any("deployment run 'evaluate-checkpoint/on-checkpoint' --watch --params" in c for c in said), said
    assert any("deployment run 'train-and-evaluate/pipeline' --watch" in c for c in said), said
    assert PAUSE_SWEEP.search(readme_section())
    assert not [c for c in said if re.search(r"(^|\s)(python|torchrun|prefect|mlflow) ", c)], "a bare command"


def checkout(root: Path) -> Path:
    """The repository's files linked under ``root`` (a user's clone), with its own ``runs/`` and
    its own ``configs/``, whose server.yaml the user edits."""
    root.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in ("runs", ".git", "configs", ".pytest_cache"):
            (root / entry.name).symlink_to(entry)
    (root / "configs").mkdir()
    for config in (REPO / "configs").iterdir():
        (root / "configs" / config.name).symlink_to(config)
    (root / "configs" / "server.yaml").unlink()
    (root / "configs" / "server.yaml").write_text(SERVER_YAML)
    return root


def test_the_readme_server_section_walked_as_written(tmp_path):
    section = readme_section()
    ports = {"4200": str(free_port()), "5000": str(free_port())}
    said = commands(section)
    deploy = next(i for i, c in enumerate(said) if " deploy --prefect-file" in c)
    said.insert(deploy + 1, PAUSE_SWEEP.search(section)[1])  # the sweep would run mid-test at :00 and :30
    script = "set -e\n" + "\n".join(re.sub(r"\b(4200|5000)\b", lambda m: ports[m[1]], c) for c in said) + "\n"
    home = with_migrated_database(tmp_path / "prefect-home")
    root = checkout(tmp_path / "clone")
    (root / "walk.sh").write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "AREAL_", "WANDB_"))}
    env |= {"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PWD": str(root)}
    log = tmp_path / "walk.log"
    walk = subprocess.Popen(
        ["bash", "walk.sh"],
        cwd=root,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # the server, workers and MLflow it starts in the background, with it
    )
    try:
        assert walk.wait(timeout=1500) == 0, log.read_text()[-5000:]
        run = root / "runs" / "ddp-server"
        # What the event path lost (a trigger action the busy server refused with a 503 is not
        # retried by Prefect) is the sweep's, as its schedule would run it: then the run is over.
        api = {**env, "PREFECT_API_URL": f"http://127.0.0.1:{ports['4200']}/api"}
        sweep = [".venv/bin/prefect", "deployment", "run", "sweep-checkpoints/every-30-minutes", "--watch"]
        swept = subprocess.run(sweep, cwd=root, env=api, capture_output=True, text=True, timeout=600)
        assert swept.returncode == 0, swept.stdout[-3000:] + swept.stderr[-3000:]
        finished = _mlflow_finished(root, "ddp-server", time.monotonic() + 300)
    finally:
        _stop_group(walk)
    out = " ".join(log.read_text().split())
    assert "areal.run.finished * server-demo" in out, out[-5000:]  # the pipeline's own line
    assert out.count("Flow run finished successfully in 'Completed'.") == 2, out[-5000:]
    # What the trigger evaluated for the trainer: with the settings of configs/server.yaml.
    results = sorted((run / "evals").glob("global_step_????????.json"))  # (not the .job or .preflight files)
    assert results and {json.loads(p.read_text())["world_size"] for p in results} == {1}
    steps = sorted(int(p.stem.rsplit("_", 1)[1]) for p in results)
    assert finished == steps
    assert sink_points.scalars(run / "tensorboard" / "areal-eval")["eval/accuracy"] == steps


def _mlflow_finished(root: Path, run_id: str, deadline: float) -> list[int]:
    """The eval steps of the run's MLflow run, once it ended FINISHED."""
    from areal_eval.tracking import Tracker, TrackingConfig

    tracker = Tracker(TrackingConfig(tracking_uri=f"sqlite:///{root / 'runs' / 'mlflow.db'}", experiment="areal-eval"))
    while True:
        mlflow_run = tracker.find_run(run_id)
        if mlflow_run and tracker.client.get_run(mlflow_run).info.status == "FINISHED":
            return sorted(tracker.eval_steps(mlflow_run))
        assert time.monotonic() < deadline, "the trainer's run never ended in MLflow"
        time.sleep(2)


def _stop_group(walk: subprocess.Popen) -> None:
    """Everything the walk started in the background, which outlives its shell: a worker needs a
    second SIGTERM; what is left after that is killed."""
    for sig, wait_s in ((signal.SIGTERM, 3), (signal.SIGTERM, 15), (signal.SIGKILL, 0)):
        try:
            os.killpg(walk.pid, sig)
        except ProcessLookupError:
            break
        time.sleep(wait_s)
    if walk.poll() is None:
        walk.wait()
