"""Where results go besides MLflow (``tracking.sinks``), and each sink's settings."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from areal_eval.config.parsing import FieldError

SINKS = ("mlflow", "wandb", "tensorboard")
"""``mlflow``: the MLflow of ``tracking.tracking_uri`` (its UI, LoggedModels, the registered
best); ``wandb``: a W&B run in the trainer's group; ``tensorboard``: event files beside the
trainer's own."""

PACKAGES = {
    "wandb": ("wandb", "pip install 'areal-eval[wandb]'"),
    "tensorboard": ("tensorboard", "pip install 'areal-eval[tensorboard]'"),
}


@dataclasses.dataclass
class WandbConfig:
    project: str | None = None
    """The W&B project; None: the trainer's (as ``PublishCheckpoints`` found it), else
    ``areal-eval``."""
    entity: str | None = None
    """The W&B entity (user or team); None: the trainer's, else the logged-in user's default."""
    group: str | None = None
    """The W&B group of the evaluation run: the trainer's run group (verl, OpenRLHF and TRL set
    one per experiment). None: the trainer's run named by ``run_id``'s group, else the training
    run's id."""
    run_id: str | None = None
    """The trainer's W&B run id. The evaluation run is a run of its own in that run's group,
    linked to it in its config (``trainer_run``): two processes never write one run. None: the
    Trainer's active run, as ``PublishCheckpoints`` found it, if any."""
    mode: str | None = None
    """``online``, ``offline`` (files only, ``wandb sync`` later) or ``disabled``; None:
    ``$WANDB_MODE``, else W&B's default."""
    init_timeout_s: float = 30.0
    """How long opening the W&B run may take before it counts as failed (W&B's own default is
    90 s): a W&B service that does not answer holds up no other record longer."""
    answers_per_table: int = 64
    """Answers in each evaluation's W&B table (the first ones, in item order); every answer stays
    in the run directory and in MLflow."""

    def __post_init__(self):
        if self.mode not in (None, "online", "offline", "disabled"):
            raise FieldError("mode", f"{self.mode!r} is not one of online, offline, disabled")
        if self.init_timeout_s <= 0:
            raise FieldError("init_timeout_s", f"must be > 0, got {self.init_timeout_s}")
        if self.answers_per_table < 0:
            raise FieldError("answers_per_table", f"must be >= 0, got {self.answers_per_table}")


@dataclasses.dataclass
class TensorBoardConfig:
    logdir: str | None = None
    """The trainer's TensorBoard log directory: the evaluation writes under ``<logdir>/<subdir>``,
    so one ``tensorboard --logdir`` shows both. None: a Hugging Face Trainer's ``logging_dir``, as
    ``PublishCheckpoints`` found it, else ``tensorboard/`` in the run directory."""
    subdir: str = "areal-eval"
    """The evaluation's own directory under ``logdir`` (a run of its own in TensorBoard)."""
    answers_per_summary: int = 8
    """Answers in each evaluation's text summary."""

    def directory(self, run_dir: str | Path) -> Path:
        """Where the evaluation's event files go for the run in ``run_dir``."""
        return Path(self.logdir or Path(run_dir) / "tensorboard") / self.subdir

    def __post_init__(self):
        if not self.subdir or "/" in self.subdir or self.subdir in (".", ".."):
            raise FieldError("subdir", f"{self.subdir!r} is not a directory name")
        if self.answers_per_summary < 0:
            raise FieldError("answers_per_summary", f"must be >= 0, got {self.answers_per_summary}")


def check_sinks(sinks: list[str]) -> None:
    """``tracking.sinks``, in one line naming the field: at least one, known names, each once,
    and each sink's package installed."""
    if not sinks:
        raise FieldError("sinks", f"names no sink: results would be seen nowhere (one or more of {', '.join(SINKS)})")
    for name in sinks:
        if name not in SINKS:
            raise FieldError("sinks", f"{name!r} is not one of {', '.join(SINKS)}")
    if len(set(sinks)) != len(sinks):
        raise FieldError("sinks", f"{sinks} names a sink twice")
    for name in sinks:
        package, how = PACKAGES.get(name, (None, None))
        if package and importlib.util.find_spec(package) is None:
            raise FieldError("sinks", f"{name} needs the {package} package, not installed here: {how}")
