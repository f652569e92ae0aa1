"""Job specs: what the orchestrator asks of a torchrun job, as one typed JSON file.

Training and evaluation workers both read their job from a spec file written by the side that
starts them, and parse it with the same strict parser as the pipeline config. One dataclass is
both sides' contract, so a default cannot drift between the flag that is built and the flag that
is parsed, and a bad field is named in the error.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TypeVar

from areal_eval import jsonl
from areal_eval.checkpoints.manifest import FileEntry
from areal_eval.checkpoints.store import S3Config
from areal_eval.config.parsing import ConfigError, from_dict
from areal_eval.evaluation.generation import GenerationConfig
from areal_eval.evaluation.lm_eval_tasks import LMEvalConfig
from areal_eval.evaluation.lm_loss import LMLossConfig

T = TypeVar("T")

COLLECTIVE_TIMEOUT_S = 60.0
"""Default timeout of every collective of an evaluation job: a dead or hung rank fails it."""


@dataclasses.dataclass(kw_only=True)
class EvaluatorSettings:
    """What configures the evaluators of a job (each takes its own section)."""

    max_length: int = 64
    """Tokens per example (reward model)."""
    dtype: str = "auto"
    """The dtype models are loaded and run in (``eval.dtype``)."""
    generation: GenerationConfig = dataclasses.field(default_factory=GenerationConfig)
    """Settings of the ``generation`` evaluator."""
    lm_loss: LMLossConfig = dataclasses.field(default_factory=LMLossConfig)
    """Settings of the ``lm_loss`` evaluator."""
    lm_eval: LMEvalConfig = dataclasses.field(default_factory=LMEvalConfig)
    """Settings of the ``lm_eval`` evaluator (lm-evaluation-harness tasks)."""


@dataclasses.dataclass
class EvalJobSpec(EvaluatorSettings):
    """One evaluation of one checkpoint, as the evaluation workers receive it."""

    checkpoint: str
    """Checkpoint directory or ``s3://`` URI."""
    data: str
    """Validation data file."""
    out: str
    """Result JSON, written whole by rank 0 (``metrics`` or ``error``)."""
    files: list[FileEntry]
    """The checkpoint's files (name, size, sha256), verified before anything is loaded."""
    cache_dir: str = "checkpoint-cache"
    """Node-local cache of downloaded checkpoints."""
    evaluator: str = "reward_model"
    """Registered evaluator name or ``module:Class``."""
    batch_size: int = 32
    """Examples per batch."""
    mp_size: int = 1
    """Ranks per model-parallel group."""
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S
    """Timeout of every collective of this job."""
    allow_pickle: bool = False
    """Load checkpoints that need pickle (unsafe)."""
    s3: S3Config | None = None
    """S3 client settings for an ``s3://`` checkpoint."""
    launched_at: float = 0.0
    """The launcher's wall time, for latency records."""
    probe_fraction: float | None = None
    """With probes: evaluate the probe subset (this share of the items) and the rest apart, and
    report the subset's metrics as ``probe_metrics`` too. None: the whole set at once."""
    probe_only: bool = False
    """A probe: the subset only (``metrics`` empty)."""
    items: bool = True
    """Write every item's results beside the result file (``eval.items``)."""
    item_text_chars: int | None = 2000
    """Texts in per-item files are cut to this many characters (``eval.item_text_chars``)."""


def to_json(spec) -> dict:
    return dataclasses.asdict(spec)


def parse_spec(cls: type[T], data: object, where: str) -> T:
    """``cls`` from a decoded spec; a bad or unknown field raises ``ConfigError`` naming ``where``."""
    try:
        return from_dict(cls, data)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def write_spec(path: str | Path, spec) -> Path:
    jsonl.write_json(path, to_json(spec))
    return Path(path)


def read_spec(cls: type[T], path: str | Path) -> T:
    if not Path(path).exists():
        raise ConfigError(f"{path}: no such job spec file")
    return parse_spec(cls, jsonl.read_json(path), str(path))
