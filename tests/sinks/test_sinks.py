"""The sinks besides MLflow through their one recording step, against the real packages: W&B in
offline mode (read back from its own run files) and TensorBoard (read back by its
``EventAccumulator``). Nothing leaves the machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_eval.runs.ledger import Ledger, LedgerEntry
from areal_eval.sinks import TensorBoardConfig, WandbConfig, open_sinks
from areal_eval.sinks.tensorboard_sink import held_points
from tests.sink_points import history, of_kind, scalars, wandb_run_id

pytestmark = pytest.mark.integration  # wandb starts its service process


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def sinks(run_dir: Path, said: list, *, logdir: Path | None = None, single_writer: bool = False):
    return open_sinks(
        ["mlflow", "tensorboard", "wandb"],
        wandb=WandbConfig(project="p", run_id="trainer-run-1"),
        tensorboard=TensorBoardConfig(logdir=str(logdir) if logdir else None),
        run_dir=run_dir,
        run_name="run-1",
        on_failure=lambda sink, message: said.append((sink, message)),
        single_writer=single_writer,
    )


def items_file(directory: Path) -> dict[str, str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    rows = [{"item": i, "prompt": f"{i}+1=", "answer": str(i + 1), "reward": 1.0} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), directory / "generation.parquet")
    return {"generation": str(directory / "generation.parquet")}


@pytest.mark.parametrize("single_writer", [False, True])
def test_every_record_lands_once_in_each_sink_across_processes_and_a_late_result_is_kept(tmp_path, single_writer):
    said: list = []
    items = items_file(tmp_path / "items")
    first = sinks(tmp_path, said, single_writer=single_writer)
    first.record_training([{"step": s, "loss": 1.0 / (s + 1)} for s in range(0, 480, 20)])  # training is at 460
    first.record_evaluation(400, {"accuracy": 0.5, "accuracy_stderr": 0.05}, items=items, uri="ckpt-400")
    first.record_evaluation(400, {"accuracy": 0.5, "accuracy_stderr": 0.05}, items=items, uri="ckpt-400")
    first.record_evaluation(200, {"accuracy": 0.4}, prefix="eval_probe/", uri="ckpt-200")
    first.record_alert("drop", 400, "accuracy fell")
    first.record_directive("rollback@400", 400, applied=True, text="rollback@400 (act): worse; applied at step 463")
    first.close()
    # The same records again from a process of its own (a rerun after kill -9): nothing lands twice.
    again = sinks(tmp_path, said)
    again.record_training([{"step": s, "loss": 1.0 / (s + 1)} for s in range(0, 500, 20)])
    again.record_evaluation(400, {"accuracy": 0.5, "accuracy_stderr": 0.05}, items=items, uri="ckpt-400")
    again.record_evaluation(480, {"accuracy": 0.6}, uri="ckpt-480")
    again.record_alert("drop", 400, "accuracy fell")
    again.record_directive("rollback@400", 400, applied=True, text="rollback@400 (act): worse; applied at step 463")
    again.record_directive("lr_scale@480", 480, applied=False, text="lr_scale@480 (shadow): flat; not applied")
    again.record_end("FINISHED")
    again.close()
    assert said == []

    points = scalars(tmp_path / "tensorboard" / "areal-eval")
    assert points["eval/accuracy"] == [400, 480] and points["eval/accuracy_stderr"] == [400]
    assert points["eval_probe/accuracy"] == [200] and points["alerts/drop"] == [400]
    assert "train/loss" not in points  # training rows: a run of their own, so results never restart them
    assert scalars(tmp_path / "tensorboard" / "areal-eval" / "train")["train/loss"] == list(range(0, 500, 20))
    assert list(held_points(tmp_path / "tensorboard" / "areal-eval")["eval/answers/text_summary"]) == [400]
    assert points["feedback/rollback"] == [400] and points["feedback/lr_scale"] == [480]
    assert (
        "applied at step 463"
        in held_points(tmp_path / "tensorboard" / "areal-eval")["feedback/rollback/text_summary"][400]
    )

    wandb_dir, run_id = tmp_path / "sinks", wandb_run_id(tmp_path)
    rows = history(wandb_dir, run_id)
    evals = [(r["eval/step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    assert evals == [(400, 0.5), (480, 0.6)]  # 400 after training logged 460: on eval/step, not dropped
    assert [r["train/step"] for r in rows if "train/loss" in r] == list(range(0, 500, 20))
    assert [r["eval/step"] for r in rows if "eval_probe/accuracy" in r] == [200]
    said_back = [(r["eval/step"], k, r[k]) for r in rows for k in r if k.startswith("feedback/") and "_why" not in k]
    assert said_back == [(400, "feedback/rollback", 1), (480, "feedback/lr_scale", 0)]  # each once
    tables = [r for r in rows if "eval/answers/_type" in r]
    assert len(tables) == 1 and tables[0]["eval/answers/nrows"] == 5 and tables[0]["eval/step"] == 400
    [alert] = of_kind(wandb_dir, run_id, "alert")
    assert alert.title == "[areal-eval] drop at step 400" and alert.text == "accuracy fell"
    runs = of_kind(wandb_dir, run_id, "run")
    assert {r.run_group for r in runs} == {"trainer-run-1"} and {r.job_type for r in runs} == {"evaluation"}
    metrics = {m.glob_name: m.step_metric for m in of_kind(wandb_dir, run_id, "metric") if m.glob_name}
    assert metrics["eval/*"] == "eval/step" and metrics["train/*"] == "train/step"


def test_a_failing_sink_is_said_in_one_line_never_stops_the_others_and_catches_up_later(tmp_path):
    said: list = []
    blocked = tmp_path / "tb"
    blocked.write_text("a file where the log directory should be")
    failing = sinks(tmp_path, said, logdir=blocked)
    failing.record_evaluation(4, {"accuracy": 0.25}, uri="ckpt-4")
    failing.record_evaluation(8, {"accuracy": 0.5}, uri="ckpt-8")
    failing.close()
    # Said once: the sink is then left alone for a while (RETRY_AFTER_S), step 8 caught up later.
    [(sink, message)] = said
    assert sink == "tensorboard" and message.startswith("step 4's result not recorded in tensorboard (retried later)")
    assert "\n" not in message
    rows = history(tmp_path / "sinks", wandb_run_id(tmp_path))
    assert [r["eval/step"] for r in rows if "eval/accuracy" in r] == [4, 8]  # W&B had them all along

    blocked.unlink()  # the directory is fixed; the next run of the command catches up from the ledger
    ledger = Ledger(tmp_path / "ledger.jsonl")
    for step, accuracy in ((4, 0.25), (8, 0.5)):
        ledger.append(LedgerEntry(step, f"ckpt-{step}", "evaluated", metrics={"accuracy": accuracy}))
    later = sinks(tmp_path, said, logdir=blocked)
    later.catch_up(ledger.entries(), tmp_path / "evals")
    later.close()
    assert scalars(blocked / "areal-eval")["eval/accuracy"] == [4, 8]
    rows = history(tmp_path / "sinks", wandb_run_id(tmp_path))
    assert [r["eval/step"] for r in rows if "eval/accuracy" in r] == [4, 8]  # none twice


def test_a_wandb_that_refuses_is_said_in_one_line_and_the_other_sink_records_on(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "no-login"))  # no stored key either
    said: list = []
    online = open_sinks(
        ["mlflow", "tensorboard", "wandb"],
        wandb=WandbConfig(project="p", mode="online"),
        tensorboard=TensorBoardConfig(),
        run_dir=tmp_path,
        run_name="run-1",
        on_failure=lambda sink, message: said.append((sink, message)),
    )
    online.record_evaluation(4, {"accuracy": 0.25}, uri="ckpt-4")
    online.close()
    [(sink, message)] = said
    assert sink == "wandb" and message.startswith("step 4's result not recorded in wandb (retried later): ")
    assert "\n" not in message
    assert scalars(tmp_path / "tensorboard" / "areal-eval")["eval/accuracy"] == [4]


def test_a_wandb_that_never_answers_fails_after_its_timeout_once_and_is_then_left_alone(tmp_path, monkeypatch):
    import socket

    listener = socket.socket()  # accepts connections on loopback and never answers
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{listener.getsockname()[1]}")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    said: list = []
    hung = open_sinks(
        ["mlflow", "tensorboard", "wandb"],
        wandb=WandbConfig(project="p", mode="online", init_timeout_s=2),
        tensorboard=TensorBoardConfig(),
        run_dir=tmp_path,
        run_name="run-1",
        on_failure=lambda sink, message: said.append((sink, message)),
    )
    try:
        for step in (4, 8, 12):
            hung.record_evaluation(step, {"accuracy": step / 16}, uri=f"ckpt-{step}")
        hung.close()
    finally:
        listener.close()
    [(sink, message)] = said  # one timeout, not one per record
    assert sink == "wandb" and message.startswith("step 4's result not recorded in wandb (retried later): ")
    assert scalars(tmp_path / "tensorboard" / "areal-eval")["eval/accuracy"] == [4, 8, 12]
