"""The training job's settings: when it saves, what it trains for, what the flow hands it.

Imported by the flow's process (the pipeline's config, the run's set-up) as well as by the ranks,
so nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from areal_eval.checkpoints.store import StorageConfig
from areal_eval.config.parsing import AT_LEAST_1, BATCH, NON_NEGATIVE, POSITIVE, RANKS, FieldError, Ranges, check_ranges
from areal_eval.launchers.devices import Devices, check_setting
from areal_eval.models.objectives import ModelConfig


@dataclasses.dataclass
class SaveConfig:
    freq_epochs: int | None = None
    """Save every this many epochs."""
    freq_steps: int | None = 25
    """Save every this many steps."""
    freq_secs: float | None = None
    """Save every this many seconds of training (monotonic, not counting downtime)."""
    at_steps: list[int] = dataclasses.field(default_factory=list)
    """Also save at exactly these steps: a schedule no frequency gives, such as Pythia's
    log-spaced early checkpoints (1, 2, 4, ... 512)."""
    eval_before_train: bool = True
    """Save the untrained model before step 1, so its evaluation is the baseline."""

    RANGES: ClassVar[Ranges] = {"freq_epochs": AT_LEAST_1, "freq_steps": AT_LEAST_1, "freq_secs": POSITIVE}

    def __post_init__(self):
        check_ranges(self, self.RANGES)
        if any(step < 1 for step in self.at_steps):
            raise FieldError("at_steps", f"steps must be >= 1, got {self.at_steps}")


@dataclasses.dataclass
class TrainConfig:
    nproc: int = 2
    """Training ranks (torchrun --nproc-per-node)."""
    devices: Devices = "auto"
    """Devices training runs on: visible GPU indices (one per rank), or CPU core ids on a machine
    without GPUs. ``auto``: the first ``nproc`` GPUs; on CPU, not pinned."""
    epochs: int = 3
    """Passes over the training data."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (None: run all epochs)."""
    batch_size: int = 16
    """Examples (pairs, or prompts with answers) per rank per step."""
    lr: float = 1e-3
    """Peak learning rate (AdamW), with linear warm-up and cosine decay."""
    warmup_steps: int = 20
    """Linear warm-up steps."""
    seed: int = 1
    """Seed of model init and data order."""
    lr_jump_at: int | None = None
    """At this global step the learning rate is multiplied by ``lr_jump_factor``, once: a collapse
    part-way to try the feedback rules on (``--preset collapse``). A rollback to a checkpoint
    before it undoes it."""
    lr_jump_factor: float = 30.0
    """What ``lr_jump_at`` multiplies the learning rate by."""
    log_every: int = 5
    """Write the training loss every this many steps."""
    collective_timeout_s: float = 120.0
    """Timeout of every collective: a dead rank fails training instead of hanging it."""
    save: SaveConfig = dataclasses.field(default_factory=SaveConfig)
    """When to save checkpoints."""
    external: bool = False
    """Training runs outside the flow: your own trainer publishes to this run's directory
    (``work_dir/run_name``: its manifest, e.g. with the Hugging Face callback). The flow starts
    no training job and follows the manifest until the final checkpoint."""
    external_timeout_s: float = 3600.0
    """With ``external``: the run fails when no checkpoint arrives for this long (the trainer
    died without publishing its final checkpoint)."""

    RANGES: ClassVar[Ranges] = {
        "nproc": RANKS,
        "epochs": AT_LEAST_1,
        "max_steps": AT_LEAST_1,
        "batch_size": BATCH,
        "lr": POSITIVE,
        "lr_jump_at": AT_LEAST_1,
        "lr_jump_factor": POSITIVE,
        "warmup_steps": NON_NEGATIVE,
        "log_every": AT_LEAST_1,
        "collective_timeout_s": POSITIVE,
        "external_timeout_s": POSITIVE,
    }

    def __post_init__(self):
        check_ranges(self, self.RANGES)
        check_setting(self.devices, "devices")


@dataclasses.dataclass
class TrainJobSpec:
    """What the orchestrator hands the training job (written to ``train_config.json``)."""

    run_id: str
    run_dir: str
    model: ModelConfig
    train: TrainConfig
    storage: StorageConfig = dataclasses.field(default_factory=StorageConfig)


def steps_per_epoch(n_examples: int, world: int, batch: int) -> int:
    # Equal step counts on every rank: DDP needs them; the remainder is reshuffled next epoch.
    return (n_examples // world) // batch


def total_steps(n_examples: int, world: int, cfg: TrainConfig) -> int:
    """Optimizer steps the job will take: all epochs, capped by ``max_steps``."""
    steps = steps_per_epoch(n_examples, world, cfg.batch_size) * cfg.epochs
    return steps if cfg.max_steps is None else min(steps, cfg.max_steps)
