"""What the TensorBoard sink writes, as a user sees it: a real ``tensorboard`` server on loopback,
its page in headless Chromium, and its own data API."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from areal_eval.sinks import TensorBoardConfig, open_sinks
from tests.helpers import free_port, require

pytestmark = pytest.mark.integration
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def test_the_evaluation_scalars_and_answers_show_on_tensorboards_page(tmp_path):
    require(CHROMIUM is not None, "no chromium here: apt-get install chromium")
    said: list = []
    trainer_logs = tmp_path / "trainer-logs"  # where a Trainer's logging_dir would be
    sinks = open_sinks(
        ["mlflow", "tensorboard"],
        wandb=None,
        tensorboard=TensorBoardConfig(logdir=str(trainer_logs), answers_per_summary=2),
        run_dir=tmp_path / "run",
        run_name="run-1",
        on_failure=lambda sink, message: said.append(message),
    )
    answers = tmp_path / "items"
    answers.mkdir()
    rows = [{"item": i, "prompt": f"{i}+2=", "answer": str(i + 2), "reward": 1.0} for i in range(3)]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), answers / "generation.parquet")
    for step, accuracy in ((10, 0.4), (30, 0.7), (20, 0.5)):  # 20 arrives last
        items = {"generation": str(answers / "generation.parquet")}
        sinks.record_evaluation(step, {"accuracy": accuracy}, items=items, uri=f"ckpt-{step}")
    sinks.close()
    assert said == []

    port = free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("tensorboard")), "--logdir", str(trainer_logs), "--host", "127.0.0.1"]
        + ["--port", str(port), "--reload_interval", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        runs = wait_for_json(f"{base}/data/runs", server)
        assert runs == ["areal-eval"]  # a run of its own beside the trainer's
        query = urllib.parse.urlencode({"run": "areal-eval", "tag": "eval/accuracy"})
        points = wait_for_json(f"{base}/data/plugin/scalars/scalars?{query}", server)
        assert [(step, round(value, 6)) for _, step, value in points] == [(10, 0.4), (20, 0.5), (30, 0.7)]
        query = urllib.parse.urlencode({"run": "areal-eval", "tag": "eval/answers/text_summary"})
        texts = wait_for_json(f"{base}/data/plugin/text/text?{query}", server)
        assert sorted(t["step"] for t in texts) == [10, 20, 30]
        assert "0+2=" in texts[0]["text"] and "1+2=" in texts[0]["text"] and "2+2=" not in texts[0]["text"]

        page = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=20000"]
            + ["--dump-dom", f"{base}/#timeseries"],
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
        assert 'eval/accuracy"' in page and "areal-eval" in page, page[-2000:]
    finally:
        server.terminate()
        server.wait(30)


def wait_for_json(url: str, server: subprocess.Popen, timeout_s: float = 60):
    """What ``url`` answers once the server is up and has read the event files."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.poll() is None, f"tensorboard exited with {server.returncode}"
        try:
            answer = json.loads(urllib.request.urlopen(url, timeout=5).read())
            if answer:
                return answer
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} gave nothing in {timeout_s} s")


def test_a_file_made_in_the_same_second_as_another_processs_still_reads_after_it(tmp_path):
    """Another process's file of this second whose pid sorts after ours: TensorBoard reads files in
    name order, so ours must not come before it, or its restart at 200 would drop our step 480."""
    import os
    import socket

    from areal_eval.sinks.tensorboard_sink import EventRun
    from tests.sink_points import scalars

    earlier = EventRun(tmp_path)
    earlier.add(400, {"eval/accuracy": 0.5})
    earlier.add(200, {"eval/accuracy": 0.4})  # late: written as a restart at 200
    earlier.close()
    [made] = tmp_path.glob("events.out.tfevents.*")
    pid = "9" * (len(str(os.getpid())) + 1)  # sorts after our pid
    made.rename(tmp_path / f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{pid}.0.{pid}")
    later = EventRun(tmp_path)
    later.add(480, {"eval/accuracy": 0.6})
    later.close()
    assert scalars(tmp_path)["eval/accuracy"] == [200, 400, 480]
    assert sorted(tmp_path.glob("events.out.tfevents.*"))[-1].name.endswith(f".{os.getpid()}")
