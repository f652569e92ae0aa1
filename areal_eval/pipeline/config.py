"""The pipeline's config: one section per component, each the component's own ``Config``.

Defaults run the demo on one machine. Load with :func:`load_pipeline_config` from a JSON/YAML
file, a dict (Prefect parameters) and ``section.field=value`` overrides; unknown fields fail
with their dotted name.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import ClassVar

from areal_eval.alerts import NOISE_AWARE_REGRESSION, AlertRule, AlertsConfig
from areal_eval.checkpoints.store import StorageConfig
from areal_eval.config.parsing import (
    POSITIVE,
    FieldError,
    Ranges,
    check_ranges,
    from_dict,
    merge,
    parse_overrides,
    read_file,
)
from areal_eval.data.math_problems import SyntheticMathProblems
from areal_eval.data.preference_data import SyntheticPreferences
from areal_eval.evaluation.evaluators import make_evaluator, produced_metrics
from areal_eval.evaluation.job_spec import EvaluatorSettings
from areal_eval.evaluation.jobs import EvalConfig
from areal_eval.feedback import FeedbackConfig, FeedbackJudge
from areal_eval.launchers.devices import check_disjoint
from areal_eval.models.objectives import ModelConfig
from areal_eval.scheduling.policy import SchedulerConfig
from areal_eval.tracking import TrackingConfig
from areal_eval.train_config import TrainConfig


@dataclasses.dataclass
class DataConfig:
    train_path: str | None = None
    """Training data: pairs (HH-RLHF JSONL) for a reward model, prompt/answer rows for SFT; None
    generates the synthetic set."""
    valid_path: str | None = None
    """Validation data, in the evaluators' form; None generates the synthetic set."""
    synthetic: SyntheticPreferences.Config = dataclasses.field(default_factory=SyntheticPreferences.Config)
    """Preference generator settings (reward model), used when a path is None."""
    math: SyntheticMathProblems.Config = dataclasses.field(default_factory=SyntheticMathProblems.Config)
    """Arithmetic word problem generator settings (SFT), used when a path is None."""


RUN_NAME_MAX = 100
RUN_NAME_PATTERN = rf"^[A-Za-z0-9][A-Za-z0-9._-]{{0,{RUN_NAME_MAX - 1}}}$"


def _default_rules() -> list[AlertRule]:
    return [
        AlertRule(name="eval-failed", kind="eval_failed", throttle_secs=0),
        AlertRule(name="nonfinite-metric", kind="nonfinite", stop_training=True, throttle_secs=0),
        AlertRule(
            name="accuracy-regression", kind="regression", metric="accuracy", min_step=1, **NOISE_AWARE_REGRESSION
        ),
    ]


@dataclasses.dataclass
class PipelineConfig:
    run_name: str = "demo"
    """Name of the training run (MLflow run name, run directory name); a name already used resumes
    that run. Started from a deployment without one, the run is named after its flow run."""
    work_dir: str = "runs"
    """Root of run directories (and of the default SQLite MLflow store)."""
    poll_interval_s: float = 0.5
    """How often the flow looks for new checkpoints and finished evaluations."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    scheduler: SchedulerConfig = dataclasses.field(
        default_factory=lambda: SchedulerConfig(min_interval_steps=25, max_interval_steps=100)
    )
    storage: StorageConfig = dataclasses.field(default_factory=StorageConfig)
    tracking: TrackingConfig = dataclasses.field(default_factory=TrackingConfig)
    alerts: AlertsConfig = dataclasses.field(default_factory=lambda: AlertsConfig(rules=_default_rules()))
    feedback: FeedbackConfig = dataclasses.field(default_factory=FeedbackConfig)
    """What evaluation asks of training (docs/feedback.md): each action in shadow mode by default."""

    RANGES: ClassVar[Ranges] = {"poll_interval_s": POSITIVE}
    PATTERNS: ClassVar[dict] = {"run_name": lambda: RUN_NAME_PATTERN}

    def __post_init__(self):
        check_ranges(self, self.RANGES)
        check_disjoint(self.train.devices, self.eval.devices, self.eval.share_devices)
        if not re.fullmatch(RUN_NAME_PATTERN, self.run_name):
            raise FieldError(
                "run_name",
                f"{self.run_name[:120]!r} must be a plain name: letters, digits, '.', '_' and '-', starting with a "
                f"letter or digit, at most {RUN_NAME_MAX} characters (it names directories, files and the MLflow run)",
            )
        self._check_metric_names()

    def _check_metric_names(self) -> None:
        """A rule or a schedule on a metric the evaluator never produces would silently never
        fire: refuse it before anything starts."""
        try:
            produced = produced_metrics(self.eval.evaluator, self.eval)
            # Built once here, so settings an evaluator refuses fail before anything starts.
            evaluator = make_evaluator(self.eval.evaluator, self.evaluator_settings)
        except FieldError:
            raise
        except (ImportError, AttributeError, ValueError) as exc:
            raise FieldError("eval.evaluator", f"{self.eval.evaluator!r} cannot be loaded: {exc}") from exc
        if self.scheduler.probe_fraction is not None and not evaluator.supports_subsets:
            raise FieldError(
                "scheduler.probe_fraction",
                f"evaluator {self.eval.evaluator!r} cannot evaluate a subset, which probes need "
                "(reward_model, generation and lm_loss can; a subclass's batches must read items())",
            )
        if produced is None:
            return
        watched = [
            ("scheduler.metric", self.scheduler.metric),
            ("scheduler.stderr_metric", self.scheduler.stderr_name),
        ]
        watched += [
            (f"alerts.rules[{i}].metric", r.metric)
            for i, r in enumerate(self.alerts.rules)
            if r.kind in ("threshold", "regression")
        ]
        watched.append(("feedback.metric", self.feedback.metric))
        for field, metric in watched:
            if metric is not None and metric not in produced:
                raise FieldError(
                    field,
                    f"{metric!r} is not a metric of evaluator {self.eval.evaluator!r} "
                    f"(it produces {', '.join(produced)})",
                )

    @property
    def evaluator_settings(self) -> EvaluatorSettings:
        """What configures the evaluators, as their jobs receive it."""
        e = self.eval
        return EvaluatorSettings(
            max_length=self.model.max_length,
            dtype=e.dtype,
            generation=e.generation,
            lm_loss=e.lm_loss,
            lm_eval=e.lm_eval,
        )

    def feedback_judge(self, items=None) -> FeedbackJudge:
        """The feedback rules, on the scheduler's metric and direction unless they name their own."""
        return FeedbackJudge(
            self.feedback, metric=self.scheduler.metric, higher_is_better=self.scheduler.higher_is_better, items=items
        )

    @property
    def run_root(self) -> Path:
        return Path(self.work_dir).resolve() / self.run_name

    @property
    def checkpoint_cache(self) -> Path:
        """Node-local cache of checkpoints fetched from the store."""
        return Path(self.storage.cache_dir or Path(self.work_dir) / "checkpoint-cache").resolve()


def load_pipeline_config(
    path: str | Path | None = None,
    params: dict | None = None,
    overrides: list[str] | None = None,
    run_name: str | None = None,
) -> PipelineConfig:
    """The config file, then ``params``, then ``overrides`` over the defaults; ``run_name``: the
    name when none of them gives one (a deployment run's own name)."""
    data: dict = read_file(path) if path else {}
    data = merge(data, params or {})
    data = merge(data, parse_overrides(overrides or []))
    if run_name is not None:
        data.setdefault("run_name", run_name)
    return from_dict(PipelineConfig, data)


UNSET_DEPLOY_VARIABLE = re.compile(r"^\{\{\s*\$(\w+)\s*\}\}$")
"""What ``prefect deploy`` leaves of ``"{{ $VAR }}"`` when ``VAR`` is not set."""


def deployment_config_path(value: str | None) -> tuple[str | None, str | None]:
    """A deployment's ``config_path`` parameter: ``(path, note)``. The path is None when the
    parameter is empty, or is ``infra/prefect.yaml``'s ``{{ $AREAL_EVAL_CONFIG }}`` left as is
    because the variable was not set at deploy time; the note then says so."""
    if not value:
        return None, None
    if unset := UNSET_DEPLOY_VARIABLE.match(value):
        return None, f"config_path: ${unset[1]} was not set when the deployment was made: the defaults apply"
    return value, None
