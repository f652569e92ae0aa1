"""Weights & Biases: a run of the evaluation's own in the trainer's group.

Two processes never write one W&B run: the trainer keeps its run, and the evaluation's run sits in
the trainer's group, linked to it (``trainer_run`` in its config), under a stable id kept in the
run directory, so every flow run of the run (and a rerun after ``kill -9``) resumes the same one.
W&B's shared mode would put both in one run, but it needs W&B's server to merge the writers, which
offline mode and a self-hosted server without it lack. The evaluation metrics have an x-axis of
their own (``eval/step``), so a result for step 400 that lands after training logged step 460 is
plotted, not dropped.

Exactly once through a crash: W&B persists what ``run.log()`` took later, in its service, so a
point is acknowledged only once the run is finished (``durable_on_close``); a run opened again
first reads what its earlier segments hold (:func:`landed`), and only the rest is sent again.
Offline, that is exactly once. Online, the check reads the same local files: a point the killed
service wrote there but had not uploaded reaches the server with ``wandb sync`` of that segment.
The files live under ``$WANDB_DIR`` when it is set, else the run directory's ``sinks``.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from areal_eval import jsonl
from areal_eval.sinks.config import WandbConfig
from areal_eval.sinks.wandb_files import history_rows, run_files

EVAL_STEP = "eval/step"
TRAIN_STEP = "train/step"


class WandbSink:
    name = "wandb"
    durable_on_close = True

    def __init__(self, config: WandbConfig, *, run_dir: str | Path, run_name: str):
        self.config = config
        self.run_dir, self.run_name = Path(run_dir), run_name
        self.dir = Path(os.environ.get("WANDB_DIR") or self.run_dir / "sinks")
        self._run = None
        self._read: dict[Path, tuple[int, set[str], int]] = {}

    def _run_id(self) -> str:
        ids = self.run_dir / "sinks" / "wandb.json"
        known = jsonl.read_json(ids, {}) or {}
        if not known.get("id"):
            known = {"id": f"{re.sub(r'[^A-Za-z0-9_-]', '-', self.run_name)[:48]}-eval-{secrets.token_hex(3)}"}
            jsonl.write_json(ids, known)
        return known["id"]

    def landed(self) -> tuple[set[str], int]:
        """What the run's segments hold, as the recording step names it: result keys
        (``eval/<step>``, ``eval_probe/<step>``, ``alert/<rule>/<step>``, ``directive/<id>``) and the
        last training step."""
        keys, through = set(), -1
        for path in run_files(self.dir, self._run_id()):
            size = path.stat().st_size
            if self._read.get(path, (-1,))[0] != size:
                self._read[path] = (size, *_keys_of(history_rows(path)))
            keys |= self._read[path][1]
            through = max(through, self._read[path][2])
        return keys, through

    def open(self) -> None:
        import wandb

        if self._run is not None:
            return
        known = {"id": self._run_id()}
        self.dir.mkdir(parents=True, exist_ok=True)
        group = self.config.group or self.config.run_id or self.run_name
        self._run = wandb.init(
            project=self.config.project,
            entity=self.config.entity,
            id=known["id"],
            name=f"{self.run_name} (evaluation)",
            group=group,
            job_type="evaluation",
            dir=str(self.dir),
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
        for prefix in ("eval/*", "eval_probe/*", "alerts/*", "feedback/*"):
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

    def directive(self, action: str, step: int, *, applied: bool, text: str) -> None:
        self._run.log({f"feedback/{action}": int(applied), f"feedback/{action}_why": text, EVAL_STEP: step})

    def end(self, status: str, *, plot: Path | None) -> None:
        import wandb

        if plot is not None and Path(plot).exists():  # in the summary: replaced, never a point more
            self._run.summary["eval/summary_plot"] = wandb.Image(str(plot))
        self._run.summary["areal/status"] = status

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


def _keys_of(rows) -> tuple[set[str], int]:
    keys, through = set(), -1
    for row in rows:
        if EVAL_STEP in row:
            step = int(row[EVAL_STEP])
            for key in row:
                if key.startswith("alerts/"):
                    keys.add(f"alert/{key.removeprefix('alerts/')}/{step}")
                elif key.startswith("feedback/") and key.count("/") == 1 and not key.endswith("_why"):
                    keys.add(f"directive/{key.removeprefix('feedback/')}@{step}")
                elif key.startswith("eval_probe/"):
                    keys.add(f"eval_probe/{step}")
                elif key.startswith("eval/") and key != EVAL_STEP:
                    keys.add(f"eval/{step}")
        if TRAIN_STEP in row:
            through = max(through, int(row[TRAIN_STEP]))
    return keys, through
