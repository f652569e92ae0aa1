"""Weights & Biases: a run of the evaluation's own in the trainer's group.

Two processes never write one W&B run: the trainer keeps its run, and the evaluation's run sits in
the trainer's group, linked to it (``trainer_run`` in its config), under a stable id kept in the
run directory, so every flow run of the run (and a rerun after ``kill -9``) resumes the same one.
W&B's shared mode would put both in one run, but it needs W&B's server to merge the writers, which
offline mode and a self-hosted server without it lack. The evaluation metrics have an x-axis of
their own (``eval/step``), so a result for step 400 that lands after training logged step 460 is
plotted, not dropped.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from areal_eval import jsonl
from areal_eval.sinks.config import WandbConfig

EVAL_STEP = "eval/step"
TRAIN_STEP = "train/step"


class WandbSink:
    name = "wandb"

    def __init__(self, config: WandbConfig, *, run_dir: str | Path, run_name: str):
        self.config = config
        self.run_dir, self.run_name = Path(run_dir), run_name
        self._run = None

    def open(self) -> None:
        import wandb

        if self._run is not None:
            return
        ids = self.run_dir / "sinks" / "wandb.json"
        known = jsonl.read_json(ids, {}) or {}
        if not known.get("id"):
            known = {"id": f"{re.sub(r'[^A-Za-z0-9_-]', '-', self.run_name)[:48]}-eval-{secrets.token_hex(3)}"}
            jsonl.write_json(ids, known)
        group = self.config.group or self.config.run_id or self.run_name
        self._run = wandb.init(
            project=self.config.project,
            entity=self.config.entity,
            id=known["id"],
            name=f"{self.run_name} (evaluation)",
            group=group,
            job_type="evaluation",
            dir=str(self.run_dir / "sinks"),
            resume="allow",
            # $WANDB_MODE read now: W&B reads it once per process, at its first run.
            mode=self.config.mode or os.environ.get("WANDB_MODE"),
            reinit="create_new",  # the trainer's own run may live in this process
            config={"areal_run": self.run_name, "trainer_run": self.config.run_id},
            settings=wandb.Settings(
                console="off", silent=True, x_disable_stats=True, init_timeout=self.config.init_timeout_s
            ),
        )
        self._run.define_metric(EVAL_STEP)
        for prefix in ("eval/*", "eval_probe/*", "alerts/*"):
            self._run.define_metric(prefix, step_metric=EVAL_STEP)
        self._run.define_metric(TRAIN_STEP)
        self._run.define_metric("train/*", step_metric=TRAIN_STEP)

    def evaluation(self, step: int, metrics: dict, *, prefix: str, answers: list[dict], uri: str) -> None:
        import wandb

        row = {prefix + k: v for k, v in metrics.items()} | {EVAL_STEP: step}
        shown = answers[: self.config.answers_per_table]
        if shown:
            columns = ["step", *dict.fromkeys(k for a in shown for k in a)]
            table = wandb.Table(columns=columns, data=[[step, *(a.get(c) for c in columns[1:])] for a in shown])
            row[prefix + "answers"] = table
        self._run.log(row)

    def training(self, rows: list[dict]) -> None:
        for row in rows:
            self._run.log({"train/" + k: v for k, v in row.items() if k != "step"} | {TRAIN_STEP: int(row["step"])})

    def alert(self, rule: str, step: int, message: str) -> None:
        import wandb

        self._run.log({f"alerts/{rule}": 1, EVAL_STEP: step})
        self._run.alert(title=f"[areal-eval] {rule} at step {step}", text=message, level=wandb.AlertLevel.WARN)

    def end(self, status: str, *, plot: Path | None) -> None:
        import wandb

        if plot is not None and Path(plot).exists():  # in the summary: replaced, never a point more
            self._run.summary["eval/summary_plot"] = wandb.Image(str(plot))
        self._run.summary["areal/status"] = status

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
